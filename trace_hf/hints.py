# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Record hints and routing at rollout, replay them in training, and measure the mismatch that is left.

Usable from any RL loop::

    with HintRecorder(model) as rec:                       # model.eval(), FP4 rollout path
        out = model.generate(**prompts, max_new_tokens=...)
    hints = rec.collect(attention_mask)                    # keyed by (sample, token position)
    ...
    with use_hints(model, hints[rows], attention_mask[rows]) as report:   # model.train()
        loss = compute_loss(model(...)); loss.backward()   # keep backward inside: checkpointing recomputes

A hint row is what `trace_hf.fp4.extract_hints` keeps of one FP4 row: its mantissa bits, block-scale bytes and fp32
row scale (docs/numerics.md, hints section). `TraceFP4Config.hint_sites` picks the rows: each token's experts input
("experts_input", the default), each routed expert's down-projection input per token and top-k slot
("experts_hidden"), and the FP4 K and V per token and KV head ("kv").
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
import weakref
from dataclasses import dataclass, field, fields

import torch

from . import fp4
from .config import HINT_SITES
from .experts import TraceFP4Experts, fp4_experts, kv_attention_of, router_of


#: Sites whose hints travel beside the experts_input fields, as ``trace_<site>_*`` columns.
EXTRA_SITES = tuple(s for s in HINT_SITES if s != "experts_input")
_PARTS = ("mantissa_bits", "block_scale", "global_scale")


def _site_on(m: TraceFP4Experts, site: str) -> bool:
    """Whether MoE layer `m` is hinted at `site` (a module marked hinted without sites is the experts_input default)."""
    if not m.hinted:
        return False
    if site == "kv":
        return "kv" in m.hint_sites and m.kv_layer is not None
    return site in m.hint_sites or (not m.hint_sites and site == "experts_input")


def hint_plan(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The MoE layers hinted at each site, sites in `HINT_SITES` order; a site with no layer is left out (e.g. "kv"
    where every hinted decoder layer has linear attention, which caches no K/V)."""
    experts = fp4_experts(model)
    plan = {site: tuple(m.moe_index for m in experts if _site_on(m, site)) for site in HINT_SITES}
    return {site: layers for site, layers in plan.items() if layers}


# ----------------------------------------------------------------------------------------------------------
# HintBatch: per-row tensors keyed by sample and token position
# ----------------------------------------------------------------------------------------------------------


@dataclass
class HintBatch:
    """Hints and routing of a batch of samples, padded per row to the longest sample.

    Row ``b``, position ``t`` is token ``t`` of sample ``b`` counted over its real (unpadded) tokens, prompt
    first. Every tensor has the samples on dim 0, so ``batch[idx]`` takes any subset or permutation of rows, and
    the tensors can travel as separate columns of a trainer's inputs (`to_inputs` / `from_inputs`).

    Attributes:
        mantissa_bits: uint8 [B, L, n_hint_layers, H/8].
        block_scale: uint8 [B, L, n_hint_layers, H/block].
        global_scale: fp32 [B, L, n_hint_layers] (ones for MXFP4).
        routing: int16 [B, L, n_moe_layers, top_k], the rollout's routed experts of every MoE layer.
        lengths: int64 [B], positions recorded per sample.
        token_ids: int32 [B, L], the token the rollout fed at each position (None if it fed embeddings). It is
            what proves the hints belong to the rows they are applied to: `use_hints` compares it with the
            forward's own ids and refuses permuted rows, other sequences or a misaligned attention mask.
        site_hints: the other sites' (mantissa_bits, block_scale, global_scale), rows and positions as above:
            ``"experts_hidden"``: [B, L, n, top_k, I/8], [B, L, n, top_k, I/block], [B, L, n, top_k] (per top-k slot,
            in the rollout's slot order); ``"kv"``: [B, L, n_kv, 2, kv_heads, D/8], [..., D/block], [B, L, n_kv, 2,
            kv_heads] (K then V). The experts_input fields above have n_hint_layers = 0 when that site is off.
    """

    mantissa_bits: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor
    routing: torch.Tensor
    lengths: torch.Tensor
    fmt: str = "nvfp4"
    hint_layers: tuple[int, ...] = ()
    token_ids: torch.Tensor | None = None
    site_hints: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    _TENSORS = ("mantissa_bits", "block_scale", "global_scale", "routing", "lengths")

    def __len__(self) -> int:
        return self.lengths.shape[0]

    def __getitem__(self, idx) -> HintBatch:
        if isinstance(idx, int):
            idx = slice(idx, idx + 1)
        return self._replace(lambda t: t[idx])

    def _replace(self, fn) -> HintBatch:
        ids = None if self.token_ids is None else fn(self.token_ids)
        sites = {site: tuple(fn(t) for t in ts) for site, ts in self.site_hints.items()}
        return HintBatch(*(fn(getattr(self, n)) for n in self._TENSORS), fmt=self.fmt, hint_layers=self.hint_layers,
                         token_ids=ids, site_hints=sites)  # fmt: skip

    def to(self, device, non_blocking: bool = False) -> HintBatch:
        return self._replace(lambda t: t.to(device, non_blocking=non_blocking))

    @property
    def width(self) -> int:
        return self.mantissa_bits.shape[-1] * 8

    @property
    def sites(self) -> tuple[str, ...]:
        """The sites recorded here, in `HINT_SITES` order."""
        on = {"experts_input"} if self.mantissa_bits.shape[2] else set()
        return tuple(s for s in HINT_SITES if s in on or s in self.site_hints)

    def bytes_per_token_by_site(self) -> dict[str, int]:
        """Hint bytes per token at each recorded site: W/8 + W/block + 4 (NVFP4) per row of width W, and a token
        has one row per hinted layer (experts_input), per layer and top-k slot (experts_hidden), per full-attention
        layer, K/V and KV head (kv)."""
        out = {}
        for site in self.sites:
            bits = self.mantissa_bits if site == "experts_input" else self.site_hints[site][0]
            rows = math.prod(bits.shape[2:-1])
            out[site] = rows * fp4.hint_bytes_per_row(bits.shape[-1] * 8, self.fmt)
        return out

    def bytes_per_token(self) -> int:
        """Hint bytes per token over all sites and hinted layers (docs/numerics.md, hints section)."""
        return sum(self.bytes_per_token_by_site().values())

    def to_inputs(self, prefix: str = "trace_") -> dict[str, torch.Tensor]:
        out = {prefix + n: getattr(self, n) for n in self._TENSORS}
        if self.token_ids is not None:
            out[prefix + "token_ids"] = self.token_ids
        for site, ts in self.site_hints.items():
            out.update({f"{prefix}{site}_{n}": t for n, t in zip(_PARTS, ts)})
        return out

    @classmethod
    def from_inputs(cls, inputs: dict, fmt: str, hint_layers, prefix: str = "trace_") -> HintBatch:
        """The batch `to_inputs` wrote (other sites' columns are found by name)."""
        sites = {
            site: tuple(inputs[f"{prefix}{site}_{n}"] for n in _PARTS)
            for site in EXTRA_SITES
            if f"{prefix}{site}_mantissa_bits" in inputs
        }
        return cls(*(inputs[prefix + n] for n in cls._TENSORS), fmt=fmt, hint_layers=tuple(hint_layers),
                   token_ids=inputs.get(prefix + "token_ids"), site_hints=sites)  # fmt: skip

    @staticmethod
    def input_keys(prefix: str = "trace_") -> list[str]:
        return [prefix + n for n in HintBatch._TENSORS]


# ----------------------------------------------------------------------------------------------------------
# Recording
# ----------------------------------------------------------------------------------------------------------


class HintRecorder:
    """Records, during `generate` (or any eval forward), the hints of every token the rollout computed at the
    hinted MoE layers and sites (`TraceFP4Config.hint_sites`), and the routed top-k expert ids of every MoE layer.

    Args:
        model: a model loaded with `TraceFP4Config` (its experts are `TraceFP4Experts`), in eval mode.
        storage: ``"device"`` keeps records where they were computed; ``"cpu"`` moves them to (pinned, when CUDA
            is present) CPU memory as they are made.
    """

    def __init__(self, model: torch.nn.Module, storage: str = "device"):
        if storage not in ("device", "cpu"):
            raise ValueError(f"HintRecorder storage={storage!r}: use 'device' or 'cpu'.")
        self.model = model
        self.storage = storage
        self.experts = fp4_experts(model)
        if not self.experts:
            raise ValueError(
                "HintRecorder needs a model loaded with quantization_config=TraceFP4Config(); this one has no FP4 "
                "experts."
            )
        self.fmt = self.experts[0].fmt
        self.hint_layers = tuple(m.moe_index for m in self.experts if m.hinted)
        self.plan = hint_plan(model)
        self._input_layers = self.plan.get("experts_input", ())
        # "kv": decoder layer of the FP4 cache -> MoE layer it is hinted with.
        self._kv_layers = {self.experts[i].kv_layer: i for i in self.plan.get("kv", ())}
        self._kv_tagged: list = []
        self._site_records: dict[str, dict[int, list]] = {}
        self._steps: list[tuple[int, int]] = []
        self._ids: list[torch.Tensor | None] = []
        self._reordered = False
        self._inputs: dict[int, list] = {}
        self._routing: dict[int, list] = {}
        self._hook = None

    def __enter__(self) -> HintRecorder:
        if self.model.training:
            raise RuntimeError("HintRecorder records the FP4 rollout path: call model.eval() before recording.")
        self._steps.clear()
        self._ids.clear()
        self._reordered = False
        self._inputs = {i: [] for i in self.hint_layers}
        self._routing = {m.moe_index: [] for m in self.experts}
        self._site_records = {site: {i: [] for i in self.plan[site]} for site in EXTRA_SITES if site in self.plan}
        self._hook = self.model.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        for m in self.experts:
            m._trace_recorder = self
        return self

    def __exit__(self, *exc) -> None:
        self._hook.remove()
        for m in self.experts:
            m._trace_recorder = None
        for layer in self._kv_tagged:
            layer._trace_recorder = None
        self._kv_tagged = []

    def _on_forward(self, module, args, kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        self._ids.append(None if x is None else self._store(x.to(torch.int32)))
        if x is None:
            x = kwargs["inputs_embeds"]
        self._steps.append((x.shape[0], x.shape[1]))
        for name in ("cache", "past_key_values"):
            cache = kwargs.get(name)
            if cache is not None and hasattr(cache, "reorder_cache") and not hasattr(cache, "_trace_watch"):
                self._watch(cache)
            if cache is not None and self._kv_layers:
                self._tag_kv(cache)

    def _tag_kv(self, cache) -> None:
        """The FP4 cache layers of "kv"-hinted decoder layers call `record_kv` with what they quantize."""
        from .kv_cache import FP4KVLayer

        for j, layer in enumerate(getattr(cache, "layers", ())):
            if (
                j in self._kv_layers
                and isinstance(layer, FP4KVLayer)
                and getattr(layer, "_trace_recorder", None) is None
            ):
                layer._trace_recorder = (self, j)
                self._kv_tagged.append(layer)

    def _watch(self, cache) -> None:
        """Beam search reorders the cache's rows between steps; the recorded columns would then mix beams."""
        original = cache.reorder_cache

        def reorder_cache(beam_idx, *a, **kw):
            self._reordered = True
            return original(beam_idx, *a, **kw)

        cache.reorder_cache = reorder_cache
        cache._trace_watch = True

    def _store(self, t: torch.Tensor) -> torch.Tensor:
        if self.storage == "cpu" and t.device.type != "cpu":
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)
        return t

    def _shape(self, t: torch.Tensor) -> torch.Tensor:
        b, s = self._steps[-1]
        if t.shape[0] != b * s:
            raise RuntimeError(
                f"HintRecorder saw {t.shape[0]} tokens at an MoE layer but the forward had batch {b} x {s}; "
                "record only forwards of the recorded model."
            )
        return t.reshape(b, s, *t.shape[1:])

    def record_input(self, module: TraceFP4Experts, q: fp4.FP4Tensor) -> None:
        if not _site_on(module, "experts_input"):
            return
        h = fp4.extract_hints(q)
        rec = (h.mantissa_bits, h.block_scale, h.global_scale.reshape(-1))
        self._inputs[module.moe_index].append(tuple(self._store(self._shape(t)) for t in rec))

    def record_hidden(self, module: TraceFP4Experts, q: fp4.FP4Tensor, inverse: torch.Tensor, top_k: int) -> None:
        """The quantized down-projection input, rows sorted by expert (``q`` [T * k, I] in the torch path, the fused
        kernels' padded [P, I]); ``inverse`` [T * k] is each (token, slot)'s row. Kept per token and slot."""
        if not _site_on(module, "experts_hidden"):
            return
        rows = fp4.FP4Tensor(
            *(t[inverse].unflatten(0, (-1, top_k)) for t in (q.packed, q.block_scale, q.global_scale)), q.fmt
        )
        self._record_site("experts_hidden", module.moe_index, rows)

    def record_kv(self, layer: int, qk: fp4.FP4Tensor, qv: fp4.FP4Tensor) -> None:
        """What the FP4 cache of decoder layer `layer` quantized ([B, kv_heads, s, ...]); kept per token as
        [2 (K, V), kv_heads, ...]."""
        if layer not in self._kv_layers:
            return
        self._record_site("kv", self._kv_layers[layer], kv_rows(qk, qv))

    def _record_site(self, site: str, layer: int, rows: fp4.FP4Tensor) -> None:
        """Hints of one forward at `site` of MoE layer `layer`; ``rows`` has the forward's tokens on dim 0."""
        h = fp4.extract_hints(rows)
        rec = (h.mantissa_bits, h.block_scale, h.global_scale.squeeze(-1))
        self._site_records[site][layer].append(tuple(self._store(self._shape(t)) for t in rec))

    def record_routing(self, module: TraceFP4Experts, top_k_index: torch.Tensor) -> None:
        self._routing[module.moe_index].append(self._store(self._shape(top_k_index.to(torch.int16))))

    def columns(self) -> tuple[torch.Tensor, ...]:
        """The recorded forwards as per-column tensors [B, cols, n_layers, ...] (bits, block scales, row scales of
        the hinted layers; routing of every MoE layer; the fed token ids [B, cols] or None), column ``j`` being the
        ``j``-th fed position of the padded batch. Checks that the forwards are one cached decode: a prefill, then one column per step."""
        if not self._steps:
            raise RuntimeError(
                "HintRecorder recorded nothing: no forward of this model ran inside the `with` block. Run generate "
                "(or a forward) inside it, with the model in eval(); a generate that does not run the model (replaced "
                "or mocked) has no hints to record."
            )
        if self._reordered:
            raise RuntimeError(
                "HintRecorder saw beam search reorder the batch between steps, so the recorded hints mix beams. "
                "Hints are recorded from sampled rollouts: generate with num_beams=1 (do_sample=True)."
            )
        b = self._steps[0][0]
        if any(sb != b for sb, _ in self._steps):
            raise RuntimeError(
                f"HintRecorder saw forwards of batch sizes {sorted({sb for sb, _ in self._steps})}: it records one "
                "batch. Beam search and other batch-reshaping strategies are not supported; sample instead."
            )
        if any(s_ != 1 for _, s_ in self._steps[1:]):
            raise RuntimeError(
                "HintRecorder saw a multi-token forward after the first one: either generate(use_cache=False), which "
                "re-feeds the whole sequence each step, or several generate calls inside one recorder. Generate with "
                "use_cache=True, and use one `with HintRecorder(...)` block (and one collect) per generate call."
            )

        def cat(parts):
            return torch.cat(parts, dim=1)

        def stack(per_layer):
            return torch.stack([cat(p) for p in per_layer], dim=2)

        routing = stack([self._routing[m.moe_index] for m in self.experts])
        ids = None if any(t is None for t in self._ids) else cat(self._ids)
        if not self._input_layers:  # no experts_input hints: empty hint tensors keep the batch layout uniform
            h, bs = self.experts[0].hidden_dim, fp4.get_format(self.fmt).block_size
            cols = routing.shape[1]
            return (
                routing.new_zeros((b, cols, 0, h // 8), dtype=torch.uint8),
                routing.new_zeros((b, cols, 0, h // bs), dtype=torch.uint8),
                routing.new_zeros((b, cols, 0), dtype=torch.float32),
                routing,
                ids,
            )
        parts = [[[p[k] for p in self._inputs[i]] for i in self._input_layers] for k in range(3)]
        return (*(stack(p) for p in parts), routing, ids)

    def site_columns(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The other sites' records as per-column tensors [B, cols, n_layers, ...] (bits, block scales, row scales),
        laid out as `columns`."""
        out = {}
        for site, layers in self._site_records.items():
            for i, recs in layers.items():
                if len(recs) != len(self._steps):
                    where = f"the FP4 K/V of decoder layer {self.experts[i].kv_layer}" if site == "kv" else site
                    raise RuntimeError(
                        f"HintRecorder saw {len(self._steps)} forwards but recorded {where} in {len(recs)}: the 'kv' "
                        "site records what the FP4 KV cache writes (TraceFP4Config(kv_cache=...), generate's own "
                        "cache); do not pass a cache of another type, or drop the site from hint_sites."
                    )
            out[site] = tuple(
                torch.stack([torch.cat([r[k] for r in layers[i]], dim=1) for i in layers], dim=2) for k in range(3)
            )
        return out

    def collect(self, attention_mask: torch.Tensor) -> HintBatch:
        """Turn the recorded forwards into a `HintBatch`.

        Args:
            attention_mask: [B, N] mask of the whole sequences (prompt and completion, left-padded prompts), e.g.
                the prompt mask concatenated with the completion mask. Column ``j`` with mask 1 is the next
                position of its sample. Columns the rollout never fed through the model (the last generated token)
                get no hint.
        """
        bits, scales, gscale, routing, ids = self.columns()
        sites = self.site_columns()
        return hint_batch_from_columns(
            bits, scales, gscale, routing, attention_mask, self.fmt, self.hint_layers, ids, site_columns=sites
        )


def kv_rows(qk: fp4.FP4Tensor, qv: fp4.FP4Tensor) -> fp4.FP4Tensor:
    """K and V as an FP4 cache holds them ([B, kv_heads, s, ...]) -> the "kv" site's rows per token,
    [B * s, 2 (K, V), kv_heads, ...]."""

    def rows(a, b):
        return torch.stack([a, b], dim=1).permute(0, 3, 1, 2, 4).flatten(0, 1)

    parts = ((qk.packed, qv.packed), (qk.block_scale, qv.block_scale), (qk.global_scale, qv.global_scale))
    return fp4.FP4Tensor(*(rows(a, b) for a, b in parts), qk.fmt)


def hint_batch_from_columns(
    bits: torch.Tensor,
    scales: torch.Tensor,
    gscale: torch.Tensor,
    routing: torch.Tensor,
    attention_mask: torch.Tensor,
    fmt: str,
    hint_layers: tuple[int, ...],
    token_ids: torch.Tensor | None = None,
    site_columns: dict[str, tuple[torch.Tensor, ...]] | None = None,
) -> HintBatch:
    """Records by padded column ([B, cols, n_layers, ...]) -> a `HintBatch` by sample position: the one layout
    every rollout path (`HintRecorder.collect`, the rollout engine) produces.

    ``attention_mask`` [B, N >= cols] covers the whole sequences; columns past ``cols`` were never fed."""
    b, cols = routing.shape[:2]
    if attention_mask.shape[0] != b:
        raise ValueError(f"attention_mask has {attention_mask.shape[0]} rows but the rollout had {b}.")
    if attention_mask.shape[1] < cols:
        raise ValueError(
            f"attention_mask has {attention_mask.shape[1]} columns but the rollout fed {cols}: pass the mask of the "
            "whole sequences (prompt mask and completion mask concatenated)."
        )
    mask = attention_mask[:, :cols].to(torch.bool).cpu()
    lengths = mask.sum(1)
    lmax = int(lengths.max())
    dev = routing.device
    # Position p of row r is its p-th real column: a stable sort of (not real) brings real columns first, in order.
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :lmax].to(dev)
    keep = (torch.arange(lmax)[None, :] < lengths[:, None]).to(dev)

    def compact(x: torch.Tensor) -> torch.Tensor:
        idx = order.reshape(b, lmax, *([1] * (x.ndim - 2))).expand(b, lmax, *x.shape[2:])
        out = torch.gather(x, 1, idx.to(x.device))
        return out * keep.reshape(b, lmax, *([1] * (x.ndim - 2))).to(device=x.device, dtype=out.dtype)

    sites = {site: tuple(compact(t) for t in ts) for site, ts in (site_columns or {}).items()}
    return HintBatch(
        compact(bits), compact(scales), compact(gscale), compact(routing), lengths.to(bits.device), fmt,
        tuple(hint_layers), None if token_ids is None else compact(token_ids[:, :cols].to(torch.int32)), sites,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# Replaying
# ----------------------------------------------------------------------------------------------------------


@dataclass
class MismatchReport:
    """What the hints corrected in one `use_hints` block (counts accumulate over its forwards).

    ``hint_flip_rate``: at hinted sites and tokens, the fraction of elements whose nearest rounding (training
    scales) differs from the hint-guided value, i.e. the flips the hints corrected; over every site, and per site
    and MoE layer in `flip_rate_by_site` / `flip_rate_by_layer`. ``flips`` / ``elements`` count per MoE layer: keys
    are the layer index for "experts_input" and ``(site, layer)`` for the other sites (for "kv" the layer is the MoE
    layer of the same decoder layer). ``routing_mismatch``: the
    fraction of (token, MoE layer) pairs whose own top-k set differs from the rollout's. ``hint_coverage``: the
    fraction of real tokens that had hints.
    """

    flips: dict[int, int] = field(default_factory=dict)
    elements: dict[int, int] = field(default_factory=dict)
    routing_diff: int = 0
    routing_total: int = 0
    hinted_tokens: int = 0
    real_tokens: int = 0
    hint_bytes_per_token: int = 0

    # A rate over zero elements is NaN, never a perfect 0: nothing was checked.
    @property
    def hint_flip_rate(self) -> float:
        n = int(sum(self.elements.values()))
        return float(sum(self.flips.values())) / n if n else math.nan

    def flip_rate_by_layer(self, site: str = "experts_input") -> dict[int, float]:
        keys = sorted(_layer(k) for k in self.flips if _site(k) == site)
        keys = [k if site == "experts_input" else (site, k) for k in keys]
        return {
            _layer(k): float(self.flips[k]) / int(self.elements[k]) if self.elements[k] else math.nan for k in keys
        }

    def counts_by_site(self) -> dict[str, tuple[int, int]]:
        """(flips, elements) per site, in `HINT_SITES` order."""
        out = {}
        for k, n in self.elements.items():
            f, e = out.get(_site(k), (0, 0))
            out[_site(k)] = (f + int(self.flips.get(k, 0)), e + int(n))
        return {s: out[s] for s in HINT_SITES if s in out}

    def flip_rate_by_site(self) -> dict[str, float]:
        return {s: f / e if e else math.nan for s, (f, e) in self.counts_by_site().items()}

    @property
    def routing_mismatch(self) -> float:
        return float(self.routing_diff) / self.routing_total if self.routing_total else math.nan

    @property
    def hint_coverage(self) -> float:
        return self.hinted_tokens / self.real_tokens if self.real_tokens else math.nan

    def as_metrics(self, prefix: str = "trace/") -> dict[str, float]:
        return {
            f"{prefix}hint_flip_rate": self.hint_flip_rate,
            **{f"{prefix}hint_flip_rate/{s}": r for s, r in self.flip_rate_by_site().items()},
            f"{prefix}routing_mismatch": self.routing_mismatch,
            f"{prefix}hint_coverage": self.hint_coverage,
            f"{prefix}hint_bytes_per_token": float(self.hint_bytes_per_token),
        }

    def merge(self, other: MismatchReport) -> None:
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, dict):
                for k, v in b.items():
                    a[k] = a.get(k, 0) + v
            elif f.name != "hint_bytes_per_token":
                setattr(self, f.name, a + b)
        self.hint_bytes_per_token = other.hint_bytes_per_token or self.hint_bytes_per_token


def _site(key) -> str:
    return key[0] if isinstance(key, tuple) else "experts_input"


def _layer(key) -> int:
    return key[1] if isinstance(key, tuple) else key


class _Guide:
    """Hints of one hinted layer laid out like the flattened [B * S, H] experts input of the batch."""

    def __init__(self, hints: fp4.FP4Hints, has: torch.Tensor, layer: int, report: MismatchReport, apply: bool):
        self.hints, self.has, self.layer, self.report = hints, has, layer, report
        self.n_has = int(has.sum())
        self.apply = apply

    def fake_quantize(self, module: TraceFP4Experts, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != self.has.shape[0]:
            raise ValueError(
                f"use_hints: the experts of MoE layer {self.layer} got {x.shape[0]} tokens but the hints were laid "
                f"out for {self.has.shape[0]} (batch x sequence of the attention_mask); pass the mask of this forward."
            )
        with torch.no_grad():
            near = fp4.quantize(x, module.fmt, "row")
            guided = fp4.guided_quantize(x, self.hints)
            has = self.has.unsqueeze(-1)
            # A flip: the nearest code (training scales) is not the code the rollout's hint selects (+-0 agree).
            cn, cg = near.codes(), guided.codes()
            flips = ((cn != cg) & (((cn | cg) & 7) != 0) & has).sum()
            y = (
                torch.where(has, guided.dequantize(x.dtype), near.dequantize(x.dtype))
                if self.apply
                else near.dequantize(x.dtype)
            )
        # Counted again when checkpointing recomputes the forward; the rates are ratios, so they are unchanged.
        self.report.flips[self.layer] = self.report.flips.get(self.layer, 0) + flips
        self.report.elements[self.layer] = self.report.elements.get(self.layer, 0) + self.n_has * x.shape[1]
        return fp4.straight_through(x, y)


class _SiteGuide:
    """Hints of one layer at a site other than experts_input, laid out per token of the flattened [B * S] batch:
    [B * S, *site rows, W] (experts_hidden: top-k slots; kv: K/V and KV heads)."""

    def __init__(self, site: str, hints: fp4.FP4Hints, has: torch.Tensor, layer: int, report, apply: bool):
        self.site, self.hints, self.has, self.layer, self.report, self.apply = site, hints, has, layer, report, apply

    def _check(self, tokens: int) -> None:
        if tokens != self.has.shape[0]:
            raise ValueError(
                f"use_hints: {self.site} of MoE layer {self.layer} got {tokens} tokens but the hints were laid out for "
                f"{self.has.shape[0]} (batch x sequence of the attention_mask); pass the mask of this forward."
            )

    def quantize(self, x: torch.Tensor, hints: fp4.FP4Hints, has: torch.Tensor) -> torch.Tensor:
        """Guided where ``has`` (x's rows but the last dim), nearest with x's own scales elsewhere; counts flips."""
        with torch.no_grad():
            near = fp4.quantize(x, hints.fmt, "row")
            guided = fp4.guided_quantize(x, hints)
            cn, cg = near.codes(), guided.codes()
            m = has.unsqueeze(-1)
            flips = ((cn != cg) & (((cn | cg) & 7) != 0) & m).sum()
            y = near.dequantize(x.dtype)
            if self.apply:
                y = torch.where(m, guided.dequantize(x.dtype), y)
        key = (self.site, self.layer)
        self.report.flips[key] = self.report.flips.get(key, 0) + flips
        self.report.elements[key] = self.report.elements.get(key, 0) + has.sum() * x.shape[-1]
        return fp4.straight_through(x, y)


class _HiddenGuide(_SiteGuide):
    """experts_hidden: a hint belongs to (token, expert). Training's top-k slot of an expert takes the hint of the
    rollout's slot of the same expert; an expert the rollout did not route the token to has no hint."""

    def __init__(self, hints, has, routing: torch.Tensor, layer, report, apply):
        super().__init__("experts_hidden", hints, has, layer, report, apply)
        self.routing = routing  # [B * S, top_k], the rollout's expert of each slot

    def fake_quantize_hidden(self, module: TraceFP4Experts, h: torch.Tensor, top_k_index: torch.Tensor):
        """``h`` [T, top_k, I] in (token, slot) order."""
        self._check(h.shape[0])
        rec = self.routing.to(top_k_index.device)
        if rec.shape != top_k_index.shape:
            raise ValueError(
                f"use_hints: experts_hidden hints of MoE layer {self.layer} were recorded for top-k {rec.shape[1]}, "
                f"the router chose {top_k_index.shape[1]}; record and train the same model."
            )
        with torch.no_grad():
            match = top_k_index.unsqueeze(-1) == rec.unsqueeze(-2)  # [T, k (training slot), k (rollout slot)]
            src = match.long().argmax(-1)
            has = match.any(-1) & self.has.to(match.device).unsqueeze(-1)

            def take(t):
                idx = src.to(t.device).reshape(*src.shape, *([1] * (t.ndim - 2))).expand(*src.shape, *t.shape[2:])
                return torch.gather(t, 1, idx)

            hi = self.hints
            hints = fp4.FP4Hints(take(hi.mantissa_bits), take(hi.block_scale), take(hi.global_scale), hi.fmt)
        return self.quantize(h, hints, has.to(hints.mantissa_bits.device))


class _KVGuide(_SiteGuide):
    """kv: the K and V of one attention layer, per token and KV head, as the FP4 cache quantized them."""

    def __init__(self, hints, has, layer, report, apply):
        super().__init__("kv", hints, has, layer, report, apply)

    def fake_quantize_kv(self, key: torch.Tensor, value: torch.Tensor):
        """``key``, ``value`` [B, kv_heads, S, D], as the attention function receives them."""
        b, heads, s, _ = key.shape
        self._check(b * s)
        x = torch.stack([key, value], dim=1).permute(0, 3, 1, 2, 4).flatten(0, 1)  # [B * S, 2, heads, D]
        has = self.has.to(x.device)[:, None, None].expand(-1, 2, heads)
        y = self.quantize(x, self.hints, has).unflatten(0, (b, s)).permute(0, 2, 3, 1, 4)  # [B, 2, heads, S, D]
        return y[:, 0].contiguous(), y[:, 1].contiguous()


def _positions(hint_batch: HintBatch, attention_mask: torch.Tensor):
    """Per padded column: the sample position it holds, and whether a hint exists there."""
    mask = attention_mask.to(torch.bool)
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    lengths = hint_batch.lengths.to(pos.device).unsqueeze(1)
    has = mask & (pos < lengths)
    return pos.clamp(max=max(hint_batch.routing.shape[1] - 1, 0)), has, mask


def _gather(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """t [B, L, ...], pos [B, S] -> [B * S, ...]."""
    idx = pos.to(t.device).reshape(*pos.shape, *([1] * (t.ndim - 2))).expand(*pos.shape, *t.shape[2:])
    return torch.gather(t, 1, idx).flatten(0, 1)


@contextlib.contextmanager
def use_hints(
    model: torch.nn.Module,
    hint_batch: HintBatch,
    attention_mask: torch.Tensor,
    routing_replay: bool = True,
    apply_hints: bool = True,
    align_positions: bool = True,
):
    """Apply hints (and optionally routing replay) to the training forwards inside the block.

    At hinted layers, tokens with a hint are quantized with the rollout's scales and recorded mantissa bits
    (`trace_hf.fp4.guided_quantize`); other tokens round to nearest. With ``routing_replay`` every MoE router
    takes the rollout's top-k ids, with weights from the training logits at those ids (so the router still
    learns). Keep the backward pass inside the block: gradient checkpointing recomputes the forward there.

    With ``apply_hints=False`` every token rounds to nearest (the "no hints" baseline) while the report still
    counts the flips the hints would have corrected. With ``align_positions`` a forward that passes no
    ``position_ids`` gets them from the attention mask
    (``cumsum - 1``), as `generate` computes them for left-padded prompts; TRL's training forward passes none,
    and the shifted rotary positions alone change the activations enough to flip many FP4 codes.

    Yields a `MismatchReport` that fills as forwards run.
    """
    if not isinstance(hint_batch, HintBatch):
        raise TypeError(
            f"use_hints needs the rollout's HintBatch, got {'None' if hint_batch is None else type(hint_batch).__name__}"
            ": the hints were not recorded (a rollout called with record=False, or generate outside a HintRecorder). "
            "Roll out with record=True (or generate inside `with HintRecorder(model) as rec:` and pass "
            "rec.collect(attention_mask)); for a training forward without hints, leave use_hints out "
            "(trace_hf.hints.aligned_positions still gives it generate's position ids)."
        )
    experts = fp4_experts(model)
    hinted = [m for m in experts if m.hinted]
    plan = hint_plan(model)
    inputs_hinted = [m for m in hinted if _site_on(m, "experts_input")]
    b, s = attention_mask.shape
    if len(hint_batch) != b:
        raise ValueError(f"use_hints: {len(hint_batch)} hint rows for an attention_mask of {b} rows.")
    if tuple(m.moe_index for m in hinted) != tuple(hint_batch.hint_layers):
        raise ValueError(
            f"use_hints: hints were recorded at MoE layers {list(hint_batch.hint_layers)} but this model hints "
            f"{[m.moe_index for m in hinted]}; record and train with the same TraceFP4Config.hint_layers."
        )
    if tuple(plan) != hint_batch.sites:
        raise ValueError(
            f"use_hints: hints were recorded at sites {list(hint_batch.sites)} but this model hints {list(plan)}; "
            "record and train with the same TraceFP4Config.hint_sites."
        )
    if hinted and hint_batch.fmt != hinted[0].fmt:
        raise ValueError(
            f"use_hints: the hints are {hint_batch.fmt} but this model's experts are {hinted[0].fmt}; record and train "
            "with the same TraceFP4Config.fmt."
        )
    if routing_replay:
        for m in experts:
            _check_replayable(router_of(model, m))
    if inputs_hinted and hint_batch.width != hinted[0].hidden_dim:
        raise ValueError(f"use_hints: hints of width {hint_batch.width} for experts of width {hinted[0].hidden_dim}.")
    if hint_batch.routing.shape[2] != len(experts):
        raise ValueError(
            f"use_hints: routing recorded for {hint_batch.routing.shape[2]} MoE layers, the model has {len(experts)}."
        )
    if experts and not model.training:
        raise RuntimeError(
            "use_hints guides the training (QAT) forward, but the model is in eval mode, where the experts run the "
            "rollout path and would apply no hint. Call model.train() inside the block (or leave use_hints out for "
            "an eval forward)."
        )
    pos, has, mask = _positions(hint_batch, attention_mask)
    report = MismatchReport(
        hinted_tokens=int(has.sum()) if hinted else 0,
        real_tokens=int(mask.sum()),
        hint_bytes_per_token=hint_batch.bytes_per_token(),
    )
    has_flat = has.flatten()
    handles, guided = [], []
    try:
        for j, m in enumerate(inputs_hinted):
            hints = fp4.FP4Hints(
                _gather(hint_batch.mantissa_bits[:, :, j], pos),
                _gather(hint_batch.block_scale[:, :, j], pos),
                _gather(hint_batch.global_scale[:, :, j], pos).unsqueeze(-1),
                hint_batch.fmt,
            )
            m._trace_guide = _Guide(hints, has_flat.to(hints.mantissa_bits.device), m.moe_index, report, apply_hints)
        for site in EXTRA_SITES:
            for j, layer in enumerate(plan.get(site, ())):
                bits, scales, gscale = (_gather(t[:, :, j], pos) for t in hint_batch.site_hints[site])
                hints = fp4.FP4Hints(bits, scales, gscale.unsqueeze(-1), hint_batch.fmt)
                h = has_flat.to(bits.device)
                m = experts[layer]
                if site == "experts_hidden":
                    if hints.width != m.intermediate_dim:
                        raise ValueError(
                            f"use_hints: experts_hidden hints of width {hints.width} for experts of intermediate "
                            f"size {m.intermediate_dim}; record and train the same model."
                        )
                    routing = _gather(hint_batch.routing[:, :, layer], pos).long()
                    m._trace_hidden_guide = _HiddenGuide(hints, h, routing, layer, report, apply_hints)
                    guided.append((m, "_trace_hidden_guide"))
                else:
                    attn = kv_attention_of(model, m.kv_layer)
                    attn._trace_kv_guide = _KVGuide(hints, h, layer, report, apply_hints)
                    guided.append((attn, "_trace_kv_guide"))
        if align_positions:
            handles.append(_register_position_hook(model, attention_mask))
        if hint_batch.token_ids is not None:
            handles.append(_register_token_check(model, hint_batch.token_ids, pos, has))
        for m in experts:
            recorded = _gather(hint_batch.routing[:, :, m.moe_index], pos).long()
            hook = _routing_hook(recorded, has_flat, routing_replay, report)
            handles.append(router_of(model, m).register_forward_hook(hook))
        yield report
        _warn_if_off_policy(model, report)
    finally:
        for m in hinted:
            m._trace_guide = None
        for mod, name in guided:
            setattr(mod, name, None)
        for h in handles:
            h.remove()


class StaleHintsWarning(UserWarning):
    """Hints applied to a model that disagrees with them far more than the policy that recorded them would."""


# Thresholds of the off-policy warning, from `python -m benchmarks.mismatch.stale_hints` (tiny Qwen3 MoE, CPU, BF16; 3 seeds)
# and the GPU runs of docs/results.md: a rollout of the same policy shows flip rates of 0.08 (CPU) to 0.19 (H200,
# QAT without hints) and routing mismatch of 0.02 to 0.22 (H200, naive FP4); another policy of the same shape 0.57
# and 0.95, and weights moved 10% 0.48 and 0.37. Warn at about twice the largest same-policy rate.
STALE_FLIP_RATE = 0.40
STALE_ROUTING_MISMATCH = 0.50
_STALE_MIN_ELEMENTS, _STALE_MIN_ROUTES = 4096, 64  # fewer: too noisy to call
_STALE_WARNED: weakref.WeakSet = weakref.WeakSet()  # models warned already: once per model


def _warn_if_off_policy(model: torch.nn.Module, report: MismatchReport) -> None:
    if model in _STALE_WARNED:
        return
    elements = int(sum(report.elements.values()))
    flips = report.hint_flip_rate if elements >= _STALE_MIN_ELEMENTS else 0.0
    routing = report.routing_mismatch if report.routing_total >= _STALE_MIN_ROUTES else 0.0
    if not (flips >= STALE_FLIP_RATE or routing >= STALE_ROUTING_MISMATCH):
        return
    _STALE_WARNED.add(model)
    warnings.warn(
        f"use_hints: the hints disagree with this model far more than a rollout of the same policy does (flip rate "
        f"{flips:.2f}, routing mismatch {routing:.2f}; the same policy shows at most about 0.19 and 0.22, another "
        f"policy 0.57 and 0.95): the rollout that recorded them ran other weights. Stale or asynchronous rollouts "
        "(a max_version_diff above 0, a weight sync that has not reached the rollout) make hints off-policy, and "
        "guiding training with them adds error instead of removing it. Roll out with the weights being trained. "
        f"(Warned once per model; thresholds trace_hf.hints.STALE_FLIP_RATE={STALE_FLIP_RATE}, "
        f"STALE_ROUTING_MISMATCH={STALE_ROUTING_MISMATCH}.)",
        StaleHintsWarning,
        stacklevel=4,  # the caller's `with use_hints(...)` (past this function, the generator and contextlib)
    )


def _register_token_check(model: torch.nn.Module, token_ids: torch.Tensor, pos: torch.Tensor, has: torch.Tensor):
    """Every forward inside `use_hints` must feed, at each hinted position, the token the rollout fed there."""
    want = torch.gather(token_ids, 1, pos.to(token_ids.device))

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or ids.shape != want.shape:
            return None
        bad = ((ids.to(want.device) != want) & has.to(want.device)).sum()
        if int(bad):
            raise ValueError(
                f"use_hints: at {int(bad)} of {int(has.sum())} hinted positions the forward's tokens differ from "
                "the ones the rollout recorded: the hint rows belong to other sequences, are permuted against "
                "these rows, or the attention_mask does not mark these rows' real tokens. Pass hint_batch[rows] "
                "with the same rows, in the same order, and their own attention mask."
            )
        return None

    return model.register_forward_pre_hook(hook, with_kwargs=True)


# Routers whose weights replay can recompute: softmax over the logits, top-k, renormalized per `norm_topk_prob`
# (the Qwen3.5 router always renormalizes and has no such attribute).
_REPLAYABLE_ROUTERS = ("Qwen3MoeTopKRouter", "Qwen3_5MoeTopKRouter", "Qwen2MoeTopKRouter", "Qwen3NextTopKRouter")


def _check_replayable(router: torch.nn.Module) -> None:
    router = getattr(router, "base_layer", router)  # a PEFT adapter on the router computes the same rule
    if type(router).__name__ not in _REPLAYABLE_ROUTERS and not hasattr(router, "norm_topk_prob"):
        raise ValueError(
            f"Routing replay recomputes the routing weights as a softmax top-k (the Qwen MoE routers); "
            f"{type(router).__name__} may weight its experts another way. Set routing_replay=False."
        )


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids as `generate` makes them for left-padded prompts: ``cumsum(mask) - 1``, pads at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _register_position_hook(model: torch.nn.Module, attention_mask: torch.Tensor):
    def hook(module, args, kwargs):
        if kwargs.get("position_ids") is None:
            mask = kwargs.get("attention_mask")
            mask = attention_mask if mask is None else mask
            kwargs["position_ids"] = position_ids_from_mask(mask).to(mask.device)
        return args, kwargs

    return model.register_forward_pre_hook(hook, with_kwargs=True)


@contextlib.contextmanager
def aligned_positions(model: torch.nn.Module, attention_mask: torch.Tensor):
    """Forwards inside get ``position_ids`` from the attention mask when they pass none, as `generate` does.

    TRL's training forward passes none, so left-padded rows would otherwise see rotary positions shifted by their
    padding, in every regime (BF16 included), and compute other activations than the rollout did.
    """
    handle = _register_position_hook(model, attention_mask)
    try:
        yield
    finally:
        handle.remove()


def _routing_hook(recorded: torch.Tensor, has: torch.Tensor, replay: bool, report: MismatchReport):
    n_has = int(has.sum())

    def hook(router, args, output):
        logits, scores, indices = output
        if indices.shape != recorded.shape:
            raise ValueError(
                f"use_hints: the router saw {tuple(indices.shape)} (tokens, top_k) but routing was recorded as "
                f"{tuple(recorded.shape)} for this batch."
            )
        rec = recorded.to(indices.device)
        mask = has.to(indices.device)
        with torch.no_grad():
            same = (indices.sort(-1).values == rec.sort(-1).values).all(-1)
            report.routing_diff += (~same & mask).sum()
            report.routing_total += n_has
        if not replay:
            return output
        idx = torch.where(mask.unsqueeze(-1), rec, indices)
        probs = torch.softmax(logits.float(), dim=-1)
        w = probs.gather(-1, idx)
        if getattr(getattr(router, "base_layer", router), "norm_topk_prob", True):
            w = w / w.sum(-1, keepdim=True)
        return logits, w.to(scores.dtype), idx

    return hook


# ----------------------------------------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------------------------------------


def moe_layer_indices(config) -> list[int]:
    """Decoder layers of a Qwen-style config that are MoE, computed from the config alone."""
    text = config.get_text_config(decoder=True)
    n = text.num_hidden_layers
    if getattr(text, "num_experts", 0) in (0, None):
        return []
    step = getattr(text, "decoder_sparse_step", 1) or 1
    dense = set(getattr(text, "mlp_only_layers", None) or [])
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def num_moe_layers(config) -> int:
    """MoE layers of a Qwen-style config, computed from the config alone."""
    return len(moe_layer_indices(config))


def hint_bytes_per_token_by_site(
    config, fmt: str = "nvfp4", hint_layers: int | None = None, sites=("experts_input",)
) -> dict[str, int]:
    """Hint bytes one token costs at each site, from a model config alone (no weights): W/8 mantissa bytes, W/block
    scale bytes and a 4-byte row scale (NVFP4) per row of width W. Per hinted MoE layer a token has one
    experts_input row (hidden_size), top_k experts_hidden rows (moe_intermediate_size) and, where the decoder layer
    has full attention, 2 * num_key_value_heads kv rows (head_dim)."""
    from .kv_cache import _full_attention_layers

    bad = [s for s in sites if s not in HINT_SITES]
    if bad or isinstance(sites, str):
        raise ValueError(f"hint_bytes_per_token: unknown sites {bad or sites!r}; give a list of {list(HINT_SITES)}.")
    text = config.get_text_config(decoder=True)
    moe = moe_layer_indices(config)
    n = (len(moe) + 1) // 2 if hint_layers is None else hint_layers
    hinted = moe[len(moe) - n :] if n else []
    row = functools.partial(fp4.hint_bytes_per_row, fmt=fmt)
    out = {}
    for site in (s for s in HINT_SITES if s in sites):
        if site == "experts_input":
            out[site] = n * row(text.hidden_size)
        elif site == "experts_hidden":
            out[site] = n * text.num_experts_per_tok * row(text.moe_intermediate_size)
        else:
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
            full = set(_full_attention_layers(config))
            out[site] = sum(i in full for i in hinted) * 2 * text.num_key_value_heads * row(head_dim)
    return out


def hint_bytes_per_token(config, fmt: str = "nvfp4", hint_layers: int | None = None, sites=("experts_input",)) -> int:
    """Hint bytes one token costs for a model config over `sites` (`hint_bytes_per_token_by_site`): per hinted layer
    H/8 mantissa bytes, H/block scale bytes and a 4-byte row scale (NVFP4) for the default experts_input."""
    return sum(hint_bytes_per_token_by_site(config, fmt, hint_layers, sites).values())
