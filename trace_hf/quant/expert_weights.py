# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The FP4 experts' weights: the conversions (free functions) and the two stores a `TraceFP4Experts` keeps them in.

* `MasterWeights` (QAT, and the naive baseline): the BF16 masters are the module's parameters; the packed FP4
  weights are re-quantized from them whenever they change (`trace_hf.quant.freshness`), into the same storage.
* `FrozenWeights` (`TraceFP4Config.freeze_experts`): the packed codes and scales are the module's buffers, under the
  parameters' own names plus `FROZEN_SUFFIXES`; there is nothing to re-quantize from.

A store holds only caches, each in a declared attribute; the tensors live on the module (so state-dict keys, FSDP2
and `model.to` see them), which is why every method takes the module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import fp4
from . import freshness


#: The two projections, and the buffer-name suffix of each `FP4Tensor` field of a frozen one: the codes keep the
#: parameter's own name (as transformers' NVFP4 layers keep theirs under `weight`), so a BF16 checkpoint's tensor
#: loads, and is quantized, under it.
PROJS = ("gate_up_proj", "down_proj")
FROZEN_SUFFIXES = {"packed": "", "block_scale": "_block_scale", "global_scale": "_global_scale"}
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ----------------------------------------------------------------------------------------------------------
# Conversions
# ----------------------------------------------------------------------------------------------------------


def quantize_experts(w: torch.Tensor, fmt: str) -> fp4.FP4Tensor:
    """Expert weights [E, N, K] in FP4 with one global scale per expert: what rollout reads and QAT dequantizes."""
    with torch.no_grad():
        return fp4.quantize(w.detach(), fmt, scale="expert")


def frozen_buffers(name: str, q: fp4.FP4Tensor) -> dict[str, torch.Tensor]:
    """The buffers of one frozen projection `name`, keyed as a checkpoint saved with `freeze_experts` holds them."""
    return {name + suffix: getattr(q, field) for field, suffix in FROZEN_SUFFIXES.items()}


def frozen_buffer_names(name: str) -> tuple[str, ...]:
    return tuple(name + suffix for suffix in FROZEN_SUFFIXES.values())


def placeholder_buffers(name: str, w: torch.Tensor, fmt: str, packed: bool) -> dict[str, torch.Tensor]:
    """Meta buffers of one frozen projection that weight loading fills: the codes in `w`'s own shape (quantized by
    `TraceFP4Quantize` as its checkpoint tensor loads) or, with `packed`, in the packed layout (a checkpoint that
    already holds the codes)."""
    e, n, k = w.shape
    bs = fp4.get_format(fmt).block_size
    g_shape = (e, 1, 1) if fmt == "nvfp4" else (e, n, 1)
    meta = {"device": "meta"}
    codes = torch.empty(e, n, k // 2, dtype=torch.uint8, **meta) if packed else torch.empty_like(w)
    return {
        name: codes,
        name + "_block_scale": torch.empty(e, n, k // bs, dtype=torch.uint8, **meta),
        name + "_global_scale": torch.empty(g_shape, dtype=torch.float32, **meta),
    }


def dequantize(q: fp4.FP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`FP4Tensor.dequantize`, through the Triton kernel on CUDA (the same values, bit for bit)."""
    if q.packed.is_cuda:
        from trace_hf.kernels.fp4_quant import dequantize as triton_dequantize

        return triton_dequantize(q, dtype)
    return q.dequantize(dtype)


def fields(q: fp4.FP4Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.packed, q.block_scale, q.global_scale


def same_layout(a: fp4.FP4Tensor, b: fp4.FP4Tensor) -> bool:
    return all(
        x.shape == y.shape and x.dtype == y.dtype and x.device == y.device for x, y in zip(fields(a), fields(b))
    )


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def masters_version(gate_up: torch.Tensor, down: torch.Tensor) -> tuple:
    """What in-place edits and moves of the masters change: version counters, storage, device."""
    return (gate_up._version, gate_up.data_ptr(), down._version, down.data_ptr(), gate_up.device)


def masters_sample(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Bits of every n-th master element (about 4K per tensor). A write through `.data` (a weight sync, a user's
    own loop) changes the values but not `_version`, so training would reuse stale fake-quantized weights; this
    sample sees any such write that touches the sampled elements (any whole-tensor update) for one small read and
    a host sync per training forward. `TRACE_HF_DEBUG=1` adds a full-tensor check (`masters_fingerprint`)."""
    if is_dtensor(gate_up):
        return ()
    out = []
    for t in (gate_up, down):
        s = t.detach().reshape(-1)[:: max(1, t.numel() // 4096)].contiguous()
        out.append(s.view(_SAME_SIZE_INT[s.element_size()]))
    return tuple(out)


def masters_fingerprint(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[float, ...]:
    with torch.no_grad():
        return tuple(float(t.detach().float().sum()) for t in (gate_up, down)) + tuple(
            float(t.detach().float().abs().sum()) for t in (gate_up, down)
        )


# ----------------------------------------------------------------------------------------------------------
# Stores
# ----------------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class PackedFromMasters:
    """Packed weights and the `masters_version` they were quantized (or loaded) at."""

    version: tuple
    weights: tuple[fp4.FP4Tensor, fp4.FP4Tensor]


@dataclass(eq=False)
class FrozenViews:
    """The frozen buffers as `FP4Tensor`s, and the buffer objects they view (a new buffer means new views)."""

    buffers: tuple[torch.Tensor, ...]
    weights: tuple[fp4.FP4Tensor, fp4.FP4Tensor]


@dataclass(eq=False)
class DequantizedCopy:
    """The dequantized packed weights (`cache_qat_weights`), valid while `source` is the store's packed record."""

    source: PackedFromMasters | FrozenViews
    weights: tuple[torch.Tensor, torch.Tensor]


class MasterWeights:
    """Packed weights re-quantized from the module's BF16 masters whenever they changed."""

    def __init__(self):
        self.packed: PackedFromMasters | None = None  # None: stale, re-quantized at the next use
        self.storage: tuple[fp4.FP4Tensor, fp4.FP4Tensor] | None = None  # kept across invalidations: graphs read it
        self.sample: tuple[torch.Tensor, ...] = ()  # `masters_sample` when the packed weights were made
        self.fingerprint: tuple[float, ...] | None = None  # `masters_fingerprint` then (TRACE_HF_DEBUG only)
        self.dequantized: DequantizedCopy | None = None

    def weight_dtype(self, m: nn.Module) -> torch.dtype:
        return m.gate_up_proj.dtype

    def packed_weights(self, m: nn.Module) -> tuple[fp4.FP4Tensor, fp4.FP4Tensor]:
        version = masters_version(m.gate_up_proj, m.down_proj)
        # In training, also a sample of the masters: `.data` edits and weight syncs bump no version counter.
        if self.packed is None or self.packed.version != version or (m.training and self.masters_edited(m)):
            self.refresh(m)
        elif freshness.DEBUG and masters_fingerprint(m.gate_up_proj, m.down_proj) != self.fingerprint:
            raise RuntimeError(
                "TraceFP4Experts: the BF16 masters changed without a refresh (an in-place `.data` edit or a weight "
                "sync), so the packed FP4 weights are stale. Call trace_hf.refresh_fp4_weights(model) after such "
                "updates."
            )
        return self.packed.weights

    def masters_edited(self, m: nn.Module) -> bool:
        now = masters_sample(m.gate_up_proj, m.down_proj)
        return len(now) != len(self.sample) or not all(map(torch.equal, now, self.sample))

    def refresh(self, m: nn.Module) -> None:
        if is_dtensor(m.gate_up_proj):  # sharded: the layer's next forward, with the gathered masters, re-quantizes
            self.invalidate()
            return
        self.pack_from(m, m.gate_up_proj, m.down_proj)

    def pack_from(self, m: nn.Module, gate_up: torch.Tensor, down: torch.Tensor):
        gu, d = quantize_experts(gate_up, m.fmt), quantize_experts(down, m.fmt)
        old = self.storage
        if old is not None and all(same_layout(a, b) for a, b in zip(old, (gu, d))):
            with torch.no_grad():
                for a, b in zip(old, (gu, d)):
                    for dst, src in zip(fields(a), fields(b)):
                        dst.copy_(src)
            gu, d = old
        self.storage = (gu, d)
        # A new record: the dequantized copy is keyed on its identity.
        self.packed = PackedFromMasters(masters_version(m.gate_up_proj, m.down_proj), (gu, d))
        self.sample = masters_sample(m.gate_up_proj, m.down_proj)
        if freshness.DEBUG:
            self.fingerprint = masters_fingerprint(m.gate_up_proj, m.down_proj)
        return gu, d

    def invalidate(self) -> None:
        self.packed = None
        self.dequantized = None

    def load(self, m: nn.Module, gate_up: fp4.FP4Tensor, down: fp4.FP4Tensor) -> None:
        with torch.no_grad():
            m.gate_up_proj.copy_(gate_up.dequantize(m.gate_up_proj.dtype))
            m.down_proj.copy_(down.dequantize(m.down_proj.dtype))
        self.packed = PackedFromMasters(masters_version(m.gate_up_proj, m.down_proj), (gate_up, down))
        self.storage = (gate_up, down)
        self.sample = masters_sample(m.gate_up_proj, m.down_proj)

    def dequantized_weights(self, m: nn.Module, dtype: torch.dtype, cache: bool):
        packed = self.packed_weights(m)
        if not cache:
            return tuple(q.dequantize(dtype) for q in packed)
        d = self.dequantized
        if d is None or d.source is not self.packed or d.weights[0].dtype != dtype:
            self.dequantized = DequantizedCopy(self.packed, tuple(q.dequantize(dtype) for q in packed))
        return self.dequantized.weights

    def after_apply(self, fn) -> None:
        """Nothing: moved or cast masters change `masters_version`, which re-quantizes."""


class FrozenWeights:
    """The module's packed buffers, viewed as `FP4Tensor`s; `dtype` is what they dequantize to (the model's)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.views: FrozenViews | None = None  # kept, so the rollout engine sees the same objects each time
        self.dequantized: DequantizedCopy | None = None

    def weight_dtype(self, m: nn.Module) -> torch.dtype:
        return self.dtype

    def packed_weights(self, m: nn.Module) -> tuple[fp4.FP4Tensor, fp4.FP4Tensor]:
        bufs = tuple(getattr(m, n) for p in PROJS for n in frozen_buffer_names(p))
        if self.views is None or any(a is not b for a, b in zip(self.views.buffers, bufs, strict=True)):
            if bufs[0].device.type == "meta" or bufs[0].dtype != torch.uint8:
                raise RuntimeError(
                    "These frozen FP4 experts hold no weights yet (still placeholders): load them with "
                    "from_pretrained(..., quantization_config=TraceFP4Config(freeze_experts=True)), or install packed "
                    "weights with load_packed_weights / pack_from."
                )
            self.views = FrozenViews(bufs, (fp4.FP4Tensor(*bufs[:3], m.fmt), fp4.FP4Tensor(*bufs[3:], m.fmt)))
        return self.views.weights

    def refresh(self, m: nn.Module) -> None:
        self.packed_weights(m)

    def pack_from(self, m: nn.Module, gate_up: torch.Tensor, down: torch.Tensor):
        self.load(m, quantize_experts(gate_up, m.fmt), quantize_experts(down, m.fmt))
        return self.packed_weights(m)

    def invalidate(self) -> None:
        """Nothing: frozen weights never go stale."""

    def load(self, m: nn.Module, gate_up: fp4.FP4Tensor, down: fp4.FP4Tensor) -> None:
        want_k = {"gate_up_proj": m.hidden_dim, "down_proj": m.intermediate_dim}
        want_n = {"gate_up_proj": 2 * m.intermediate_dim, "down_proj": m.hidden_dim}
        for name, q in zip(PROJS, (gate_up, down), strict=True):
            shape = (m.num_experts, want_n[name], want_k[name])
            if q.fmt != m.fmt or tuple(q.shape) != shape:
                raise ValueError(
                    f"load_packed_weights: {name} is {q.fmt} of shape {tuple(q.shape)}, but these experts hold {m.fmt} "
                    f"of shape {shape}; quantize the weights with fp4.quantize(w, {m.fmt!r}, scale='expert')."
                )
            old = getattr(m, name)
            device = old.device if old.device.type != "meta" else q.packed.device
            for n, t in frozen_buffers(name, q).items():
                t = t.detach().to(device)
                setattr(m, n, t.float() if n.endswith("_global_scale") else t.contiguous())
        self.views = self.dequantized = None

    def dequantized_weights(self, m: nn.Module, dtype: torch.dtype, cache: bool):
        packed = self.packed_weights(m)
        if not cache:
            return tuple(dequantize(q, dtype) for q in packed)
        d = self.dequantized
        if d is None or d.source is not self.views or d.weights[0].dtype != dtype:
            self.dequantized = DequantizedCopy(self.views, tuple(dequantize(q, dtype) for q in packed))
        return self.dequantized.weights

    def after_apply(self, fn) -> None:
        """The views hold the buffers from before, and the model dtype may have changed."""
        self.views = self.dequantized = None
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype
