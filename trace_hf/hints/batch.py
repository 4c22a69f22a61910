# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`HintBatch`: the rollout's hints and routing as per-row tensors, keyed by sample and token position."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import fp4
from ..quant.config import HINT_SITES


#: Sites whose hints travel beside the experts_input fields, as ``trace_<site>_*`` columns.
EXTRA_SITES = tuple(s for s in HINT_SITES if s != "experts_input")
_PARTS = ("mantissa_bits", "block_scale", "global_scale")


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

    def site(self, site: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mantissa_bits, block_scale, global_scale) of one site, [B, L, n_layers, ...]: the same access for every
        site, whether its columns are the top-level fields (experts_input) or `site_hints`."""
        if site == "experts_input":
            return self.mantissa_bits, self.block_scale, self.global_scale
        return self.site_hints[site]

    def bytes_per_token_by_site(self) -> dict[str, int]:
        """Hint bytes per token at each recorded site: W/8 + W/block + 4 (NVFP4) per row of width W, and a token
        has one row per hinted layer (experts_input), per layer and top-k slot (experts_hidden), per full-attention
        layer, K/V and KV head (kv)."""
        out = {}
        for site in self.sites:
            bits = self.site(site)[0]
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
