# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Padding-free packed training-side forwards (``TraceGRPOConfig.token_budget``): which rows share a forward, how
their per-token values go back to TRL's layout, and an attention that keeps the rows apart without a dense mask.

transformers keeps packed rows apart under `sdpa` or `eager` with a dense block-diagonal mask built from the
restarting position ids: every pair of packed tokens goes through the masked kernel, and on the H200 that made the
training side 1.5x slower than the padded path (docs/benchmarks.md). So a packed forward swaps the model's attention
for `varlen_attention` for its duration: each row attends to its own tokens only (PyTorch's variable-length flash
attention on CUDA in half precision, one causal `sdpa` call per row elsewhere), and no mask is built. The FP4 K/V
fake quantization (`trace_fp4_kv:<fmt>:<base>`) keeps wrapping it: it is per token and head, so packing does not
change what it sees.

Gated DeltaNet layers (Qwen3.5) carry a state along the sequence, and transformers' torch rules and causal conv
ignore packed boundaries (its `cu_seq_lens_q` reaches only flash-linear-attention's kernels). So within a packed
forward each of those layers takes the packed rows right-padded to the longest, in one call (`_rows_padded`): each
row's state starts at zero as in the padded path, and only the chunked rule's chunk boundaries (counted from the
row's first token rather than the left-padded row's) can change the summation order.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from ..quant.kv_cache import KV_PREFIX, kv_attention


try:  # PyTorch's variable-length flash attention (CUDA, torch >= 2.10); elsewhere a causal sdpa per row
    from torch.nn.attention.varlen import varlen_attn

    #: Its keyword arguments, which moved between releases: 2.10 takes ``is_causal``; later ones ``scale`` and
    #: ``window_size`` (causal is ``(-1, 0)``); 2.12 adds ``enable_gqa``.
    _VARLEN_ARGS = frozenset(inspect.signature(varlen_attn).parameters)
except ImportError:  # pragma: no cover - older torch
    varlen_attn, _VARLEN_ARGS = None, frozenset()

#: The attention implementation a packed forward runs under; the FP4 KV wrapper names it as its base.
PACKED_ATTENTION = "trace_packed"


@dataclass(frozen=True, eq=False)
class PackedRows:
    """The rows of the packed forward in flight: their boundaries in the packed sequence and the longest row."""

    cu_seqlens: torch.Tensor  # int32 [rows + 1], on the model's device
    lengths: tuple[int, ...]


#: The packed forwards open now, innermost last. A plain module list rather than a context variable: the checkpointed
#: recompute runs in backward, on autograd's device threads on CUDA, which see no context variable the forward set.
_OPEN: list[PackedRows] = []
#: The row lengths (int32 [rows], on the device) of the Gated DeltaNet forwards that `_rows_padded` runs now,
#: innermost last; the same kind of list, for the same reason.
_PADDED: list[tuple[torch.Tensor, int]] = []  # (lengths, the longest)


def padded_row_lengths(rows: int, longest: int) -> torch.Tensor | None:
    """Inside a Gated DeltaNet forward over packed rows right-padded to the longest (`_rows_padded`): the rows'
    lengths, when a call over [rows, longest, ...] is that forward's own (its delta rule); else None. The rule then
    steps each row's own tokens only (`trace_hf.kernels.gated_delta_recurrent`)."""
    if _PADDED and _PADDED[-1][0].shape[0] == rows and _PADDED[-1][1] == longest:
        return _PADDED[-1][0]
    return None


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature ([1, heads, tokens, dim] in, [1, tokens, heads, dim] out) over the packed
    rows of `packed_rows`: each row causal over its own tokens."""
    if not _OPEN:
        raise RuntimeError("trace_packed attention runs only inside a packed forward (trace_hf.train.packing).")
    rows = _OPEN[-1]
    if query.size(2) != sum(rows.lengths):
        raise RuntimeError(
            f"trace_packed attention got {query.size(2)} tokens inside a packed forward of rows {list(rows.lengths)} "
            f"({sum(rows.lengths)} tokens): a forward ran under another packed forward's context."
        )
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("token_budget does not pack sliding-window attention; set token_budget=0.")
    if dropout:
        raise NotImplementedError("token_budget does not pack attention with dropout; set token_budget=0.")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, dim]
    gqa = q.size(1) != k.size(1)
    half = q.dtype in (torch.float16, torch.bfloat16)  # flash attention's dtypes; fp32 runs each row's sdpa
    flash = _varlen_kwargs(scaling, q.size(-1), gqa) if q.is_cuda and half and varlen_attn is not None else None
    if flash is not None:
        if gqa and "enable_gqa" not in flash:
            k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
        n = max(rows.lengths)
        out = varlen_attn(q, k, v, rows.cu_seqlens, rows.cu_seqlens, n, n, **flash)
    else:
        out = torch.cat([
            F.scaled_dot_product_attention(
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), is_causal=True, scale=scaling,
                enable_gqa=gqa,
            ).transpose(0, 1)
            for qs, ks, vs in zip(*(t.split(rows.lengths) for t in (q, k, v)), strict=True)
        ])  # fmt: skip
    return out.unsqueeze(0), None


def _varlen_kwargs(scaling: float | None, head_dim: int, gqa: bool) -> dict | None:
    """`varlen_attn`'s keyword arguments for a causal attention at ``scaling`` in this torch, or None where it has
    no way to take them (then each row runs its own sdpa)."""
    kwargs = {"is_causal": True} if "is_causal" in _VARLEN_ARGS else {"window_size": (-1, 0)}
    if "window_size" not in _VARLEN_ARGS and "is_causal" not in _VARLEN_ARGS:
        return None
    if scaling is not None and "scale" in _VARLEN_ARGS:
        kwargs["scale"] = scaling
    elif scaling is not None and scaling != head_dim**-0.5:
        return None  # no scale argument: only the default 1/sqrt(head_dim)
    if gqa and "enable_gqa" in _VARLEN_ARGS:
        kwargs["enable_gqa"] = True
    return kwargs


def _no_mask(*args, **kwargs):
    return None  # varlen_attention keeps the rows apart itself


AttentionInterface.register(PACKED_ATTENTION, varlen_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, _no_mask)


def _packed_name(impl: str) -> str:
    """The attention a packed forward runs in place of `impl`: `varlen_attention`, under the FP4 KV wrapper if any."""
    parts = impl.split(":")  # trace_fp4_kv:<fmt>:<base>[:noqat]
    return kv_attention(PACKED_ATTENTION, parts[1], len(parts) < 4) if parts[0] == KV_PREFIX else PACKED_ATTENTION


def sequence_mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers that carry a state along the sequence (Gated DeltaNet), which a packed forward gives its rows padded."""
    return [m for m in model.modules() if "GatedDeltaNet" in type(m).__name__]


#: The names a Gated DeltaNet forward takes its cache under (transformers renamed `cache_params` to `cache`).
_CACHE_ARGS = ("cache", "cache_params", "past_key_values")


def _rows_padded(module: torch.nn.Module, lengths: tuple[int, ...], device: torch.device):
    """`module`'s forward (an accelerate hook's, where one is installed) over a packed [1, N, H] sequence as one call
    on its rows right-padded to the longest, [rows, longest, H], without mask or cache. Each row starts at position 0
    with a zero state, as in the padded path; the conv and the rule are causal, so the padding after a row's tokens
    cannot reach them, and its outputs are dropped."""
    forward = module.forward
    longest = max(lengths)
    # Where each packed token sits in the [rows * longest] layout.
    slots = torch.cat([torch.arange(n) + r * longest for r, n in enumerate(lengths)]).to(device)
    row_lengths = torch.tensor(lengths, dtype=torch.int32, device=device)

    def padded(hidden_states, *args, attention_mask=None, **kwargs):
        if hidden_states.shape[:2] != (1, sum(lengths)):
            raise RuntimeError(
                f"A packed forward of rows {list(lengths)} reached {type(module).__name__} with hidden states of "
                f"shape {tuple(hidden_states.shape)}; it expects [1, {sum(lengths)}, hidden]."
            )
        h = hidden_states[0]
        rows = h.new_zeros(len(lengths) * longest, h.shape[-1]).index_copy(0, slots, h)
        # No cache: each row's state must start at zero, not where another row left it.
        kwargs = {k: v for k, v in kwargs.items() if k not in _CACHE_ARGS}
        _PADDED.append((row_lengths, longest))
        try:
            out = forward(rows.view(len(lengths), longest, -1), *args, **kwargs)
        finally:
            _PADDED.pop()
        return out.reshape(len(lengths) * longest, -1)[slots].unsqueeze(0)

    return padded


@contextlib.contextmanager
def packed_attention(model: torch.nn.Module, lengths: list[int]):
    """Within the context, `model`'s attention keeps the packed rows of these `lengths` apart (`varlen_attention`),
    builds no mask, and its Gated DeltaNet layers take the rows right-padded (`_rows_padded`). Kept open until backward is done, so checkpointed
    layers recompute the same way."""
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None}
    saved = [(c, c._attn_implementation) for c in configs.values() if getattr(c, "_attn_implementation", None)]
    device = next(model.parameters()).device
    cu = torch.tensor([0, *lengths], device=device).cumsum(0, dtype=torch.int32)
    rows = PackedRows(cu, tuple(lengths))
    _OPEN.append(rows)
    for c, impl in saved:
        c._attn_implementation = _packed_name(impl)
    mixers = [(m, m.__dict__.get("forward")) for m in sequence_mixers(model)]
    for m, _ in mixers:
        m.forward = _rows_padded(m, tuple(lengths), device)
    try:
        yield
    finally:
        for m, own in mixers:
            if own is None:
                del m.forward  # back to the class's forward
            else:
                m.forward = own
        for c, impl in saved:
            c._attn_implementation = impl
        _OPEN.remove(rows)


def token_chunks(lengths: list[int], budget: int | None, padded: bool = False) -> list[tuple[int, int]]:
    """Packed forwards as row ranges [lo, hi): rows in their order, as many as fit ``budget`` (next fit, so the count
    never rises with the budget); a row longer than the budget has a forward of its own. The budget counts real
    tokens, or with ``padded`` rows x the longest row: the positions `_rows_padded` gives the Gated DeltaNet layers,
    which would otherwise grow past the budget when many short rows share a forward with a long one."""
    chunks, lo, longest = [], 0, 0
    tokens = 0
    for r, n in enumerate(lengths):
        cost = (r - lo + 1) * max(longest, n) if padded else tokens + n
        if budget is not None and r > lo and cost > budget:
            chunks.append((lo, r))
            lo, tokens, longest = r, 0, 0
        tokens, longest = tokens + n, max(longest, n)
    return [*chunks, (lo, len(lengths))]


def unpack(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The fused LM head's [1, N - 1] per-token values of a packed forward (entry i scores packed token i + 1) ->
    [rows, width] in the rows' own columns, 0 at padding and at each row's first token (never a completion token)."""
    values = torch.cat([values.new_zeros(1), values[0]])
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


#: The attention implementations that compute plain causal softmax attention, which `varlen_attention` stands in for.
_REPLACEABLE_ATTENTION = ("eager", "sdpa", "flex_attention")


def packing_refusal(model) -> str | None:
    """Why a packed forward would not compute each row of `model` on its own (None: it would)."""
    text = model.config.get_text_config()
    impl = text._attn_implementation or "eager"
    base = impl.split(":")[2] if impl.startswith(KV_PREFIX + ":") else impl  # the FP4 KV wrapper's own base
    if base not in _REPLACEABLE_ATTENTION and "flash" not in base:
        return (
            f"packed forwards run their own causal attention in place of the model's, and {base!r} may compute "
            "something else. Load the model with attn_implementation='sdpa' (or 'eager', 'flex_attention', "
            "'flash_attention_2')"
        )
    types = set(getattr(text, "layer_types", None) or ())
    other = sorted(types - {"full_attention", "linear_attention"})
    if other or ("linear_attention" in types and not sequence_mixers(model)):
        return (
            f"this {text.model_type} model has {other or 'linear-attention layers other than Gated DeltaNet'}, which "
            "a packed forward does not keep apart per row (sliding windows are not packed; only Gated DeltaNet takes "
            "its rows padded)"
        )
    return None


def resolve_token_budget(model, token_budget: int | None) -> int | str | None:
    """What `TraceGRPOConfig.token_budget` means for `model`: an int budget, ``"auto"`` (each scoring forward packs
    the tokens its padded micro-batch would hold), or None (TRL's padded micro-batches).

    None (the default) packs wherever the packed forward keeps the rows apart: all-attention models (Qwen3 MoE) and
    Gated DeltaNet ones (Qwen3.5 MoE), both measured faster packed (docs/benchmarks.md). A budget <= 0 turns packing
    off, as in TRL; a budget > 0 on a model that cannot pack is refused."""
    if token_budget is not None and token_budget <= 0:
        return None
    refusal = packing_refusal(model)
    if token_budget is None:
        return "auto" if refusal is None else None
    if refusal is not None:
        raise ValueError(f"TraceGRPOConfig(token_budget={token_budget}): {refusal}; or set token_budget=0.")
    return token_budget
