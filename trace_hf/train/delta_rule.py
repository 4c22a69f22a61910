# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Gated DeltaNet (Qwen3.5, Qwen3-Next) in training forwards with the rollout's numerics.

The rollout steps the gated delta rule one token at a time; transformers' forward over a whole sequence runs the
chunked form, which sums the same terms in another order. On a warmed Qwen3.5 MoE in BF16 that reassociation is
the only block whose own output differs between rollout and training, and hints cannot reach it (it is not an FP4
site; docs/results.md section 7). ``TraceGRPOConfig(gated_delta_rule="recurrent")`` makes every training-side
forward take the recurrent form's values (transformers' torch rule: the engine's torch step op for op, its Triton
step on CUDA up to fp32 summation order; on CUDA computed by `trace_hf.kernels.gated_delta_recurrent`, one launch
over the sequence instead of the torch loop's ~10 per token, the same values up to fp32 summation order). On CUDA
the gradient is that kernel's own, the recurrence's exact gradient by a backward kernel (no chunked forward runs);
elsewhere the chunked form's, straight through (the two forms differ by rounding). No-grad forwards (the old
log-probs) run the recurrent form alone.

transformers picks the form inside the module's forward by sequence length, from module-level functions, and has
no per-module hook for it, so `recurrent_values` rebinds the chunked function of the model's modeling modules for
the duration of a context (the trainer's forward and its backward, so checkpointed recomputes see it too).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable

import torch

from ..fp4 import straight_through
from .packing import padded_row_lengths


#: "auto": "recurrent" on models with Gated DeltaNet layers (cheaper and closer to the rollout, docs/benchmarks.md),
#: nothing to choose on the others.
GATED_DELTA_RULES = ("auto", "chunk", "recurrent")
_CHUNK, _RECURRENT = "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"
_WRAPPERS: set = set()  # the rebound functions, so a nested context does not wrap them twice
#: Whether training forwards take the recurrent kernel's own gradient where it applies (else the chunked form's,
#: straight through: the before of the backward kernel, which `grpo_step --recurrent-chunk-gradient` times).
KERNEL_GRADIENT = True
#: Whether the kernel steps only each packed row's own tokens in the forwards that give Gated DeltaNet layers their
#: rows right-padded (`packing.padded_row_lengths`): the same values and gradients for every real token, without the
#: padding's share of the sequential loop (`grpo_step --rule-over-padding` times the before).
SKIP_ROW_PADDING = True


def delta_rule_modules(model: torch.nn.Module) -> list:
    """The modeling modules (Python modules) whose layers in `model` compute a gated delta rule."""
    found = {}
    for m in model.modules():
        mod = sys.modules.get(type(m).__module__)
        if (
            mod is not None
            and hasattr(mod, _CHUNK)
            and hasattr(mod, _RECURRENT)
            and "GatedDeltaNet" in type(m).__name__
        ):
            found[mod.__name__] = mod
    return list(found.values())


def resolve_gated_delta_rule(model: torch.nn.Module, rule: str) -> str:
    """``TraceGRPOConfig.gated_delta_rule`` for ``model``: "auto" is "recurrent" where it has Gated DeltaNet layers,
    else "chunk" (no layer to apply either to); "recurrent" on a model without them is refused."""
    has = bool(delta_rule_modules(model))
    if rule == "recurrent" and not has:
        raise ValueError(
            f"gated_delta_rule='recurrent' applies to models with Gated DeltaNet layers (Qwen3.5, Qwen3-Next); this "
            f"{model.config.model_type} model has none. Leave TraceGRPOConfig.gated_delta_rule='auto'."
        )
    if rule == "auto":
        return "recurrent" if has else "chunk"
    return rule


def torch_rule(fn) -> Callable:
    """transformers' own torch function behind the hub-kernel wrappers it puts on its delta rules.

    Without the `kernels` package (transformers < 5.25) the wrappers are `functools.wraps` chains; with it (a
    transformers dependency from 5.25) each rule is a `kernels` `Func` module whose forward closes over the wrapped
    function. Either way the torch rule is what the engine's decode step follows, also where fla is installed.
    """
    if isinstance(fn, torch.nn.Module):
        fn = inspect.getclosurevars(type(fn).forward).nonlocals.get("func")
        if not callable(fn):
            raise RuntimeError(
                "trace-hf cannot find transformers' torch gated delta rule behind this `kernels` version's wrapper; "
                "install the versions pyproject.toml lists (README.md, Install) or report the versions in use."
            )
    return inspect.unwrap(fn)


def torch_rules(module) -> tuple[Callable, Callable]:
    """The torch chunked and recurrent gated delta rules of a modeling module (e.g. transformers' modeling_qwen3_5_moe)."""
    return torch_rule(getattr(module, _CHUNK)), torch_rule(getattr(module, _RECURRENT))


def _use_kernel(query: torch.Tensor) -> bool:
    """Whether the recurrent values come from `trace_hf.kernels.gated_delta_recurrent` (CUDA) rather than the loop."""
    return query.is_cuda


def _kernel_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether `trace_hf.kernels.gated_delta_recurrent` takes this call: on CUDA, head sizes powers of two (its tiles)."""
    dk, dv = key.shape[-1], value.shape[-1]
    return _use_kernel(query) and not (dk & (dk - 1) or dv & (dv - 1))


def _recurrent_rule(torch_recurrent: Callable) -> Callable:
    """The recurrent rule for a call: the kernel where `_kernel_applies` (one launch over the sequence; transformers'
    torch rule up to fp32 summation order); else the torch loop."""

    def recurrent(query, key, value, *args, **kwargs):
        if _kernel_applies(query, key, value):
            from trace_hf.kernels.gated_delta_recurrent import recurrent_gated_delta_rule

            lengths = padded_row_lengths(*query.shape[:2]) if SKIP_ROW_PADDING else None
            return recurrent_gated_delta_rule(query, key, value, *args, lengths=lengths, **kwargs)
        return torch_recurrent(query, key, value, *args, **kwargs)

    return recurrent


def _recurrent_values(chunk, recurrent):
    """A chunked gated delta rule whose values are `recurrent`'s. Its gradient: the kernel's own (the recurrence's,
    `RecurrentRule`) where the kernel applies and the call starts from no state, as training forwards do; elsewhere
    `chunk`'s, straight through."""

    def delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, **kwargs):  # fmt: skip
        common = {"initial_state": initial_state, "output_final_state": output_final_state,
                  "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel}  # fmt: skip
        if kwargs.get("cu_seqlens") is not None:
            raise ValueError(
                "gated_delta_rule='recurrent' steps each row on its own and cannot split packed sequences "
                "(cu_seqlens). Pack with TraceGRPOConfig.token_budget, which gives these layers each row on its own, or use "
                "gated_delta_rule='chunk'."
            )
        inputs = (query, key, value, g, beta)
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
            return recurrent(*inputs, **common)
        if KERNEL_GRADIENT and initial_state is None and _kernel_applies(query, key, value):
            return recurrent(*inputs, **common)  # differentiable: no chunked forward to keep for backward
        out, state = chunk(*inputs, chunk_size=chunk_size, **common, **kwargs)
        with torch.no_grad():
            r_out, r_state = recurrent(*inputs, **common)
        return straight_through(out, r_out), (None if state is None else straight_through(state, r_state))

    _WRAPPERS.add(delta_rule)
    return delta_rule


@contextlib.contextmanager
def recurrent_values(model: torch.nn.Module):
    """Within the context, `model`'s Gated DeltaNet layers compute training forwards with the recurrent form's values
    (transformers' torch recurrent rule, what the engine's decode step follows) and the chunked form's gradient."""
    modules = delta_rule_modules(model)
    if not modules:
        raise ValueError(
            f"gated_delta_rule='recurrent' applies to models with Gated DeltaNet layers (Qwen3.5, Qwen3-Next); this "
            f"{type(model).__name__} has none. Leave TraceGRPOConfig.gated_delta_rule='auto'."
        )
    saved = [(mod, getattr(mod, _CHUNK)) for mod in modules if getattr(mod, _CHUNK) not in _WRAPPERS]
    for mod, chunk in saved:
        # The torch recurrent rule: transformers binds flash-linear-attention's kernel in its place when that imports,
        # and the engine follows the torch one.
        setattr(mod, _CHUNK, _recurrent_values(chunk, _recurrent_rule(torch_rule(getattr(mod, _RECURRENT)))))
    try:
        yield
    finally:
        for mod, chunk in reversed(saved):
            _WRAPPERS.discard(getattr(mod, _CHUNK))
            setattr(mod, _CHUNK, chunk)
