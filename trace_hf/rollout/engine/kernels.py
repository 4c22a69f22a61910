# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The Triton kernel modules the engine calls, held by name.

Why a holder: `trace_hf.kernels` is bound at import of `trace_hf` (the top-level ``kernels/`` folder), and the
engine's modules must import without it (an install without the kernels still imports `trace_hf.rollout`), so the
kernels are imported on first use, once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Kernels:
    """Attributes:
    ops: `decode_ops`: add + RMSNorm (fused with the experts' FP4 input quantization), router top-k, linear/gemv.
    attention: `fp4_attention`: the static KV cache, q/k norm + RoPE + cache write, split-K decode attention.
    moe: `fp4_moe`: the routed experts.
    gated_delta: `gated_delta`: Gated DeltaNet's decode step (Qwen3.5's linear attention).
    pdl: `pdl`: programmatic dependent launch, by the decode step's rows (`pdl.for_rows`).
    """

    ops: ModuleType
    attention: ModuleType
    moe: ModuleType
    gated_delta: ModuleType
    pdl: ModuleType


@functools.cache
def kernels() -> Kernels:
    from trace_hf.kernels import decode_ops, fp4_attention, fp4_moe, gated_delta, pdl

    return Kernels(ops=decode_ops, attention=fp4_attention, moe=fp4_moe, gated_delta=gated_delta, pdl=pdl)
