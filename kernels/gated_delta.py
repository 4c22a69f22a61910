# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""One decode token of the gated delta rule (Gated DeltaNet, Qwen3.5's linear attention), in place on its state.

Why: the rule's state is [B, Hv, Dk, Dv] fp32 (2 MB a sequence per layer at Qwen3.5-35B-A3B's 32 x 128 x 128), and
a decode step is bound by reading it. transformers' torch step (and `trace_hf.rollout.engine.qwen35`'s default) passes
over it six times (decay, two matrix-vector products, the rank-one update, in place); this kernel reads it once
and writes it once. It runs under the CPU interpreter (CI) and in CUDA graphs, on any Triton, which is why it is
not flash-linear-attention's ``fused_recurrent_gated_delta_rule``.
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.gated_delta (see kernels/README.md), not kernels.gated_delta.")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trace_hf.kernels.common import INTERPRETED  # noqa: E402


@triton.jit
def _gated_delta_step_kernel(s_ptr, q_ptr, k_ptr, v_ptr, decay_ptr, beta_ptr, o_ptr, HV, HK, DK: tl.constexpr,
                             DV: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)  # b * HV + value head
    b, h = bh // HV, bh % HV
    kh = b * HK + h // (HV // HK)  # value head h reads key head h // (HV / HK), as repeat_interleave
    dk = tl.arange(0, DK)
    dv = tl.program_id(1) * BV + tl.arange(0, BV)
    q = tl.load(q_ptr + kh * DK + dk)
    k = tl.load(k_ptr + kh * DK + dk)
    v = tl.load(v_ptr + bh * DV + dv)
    at = s_ptr + bh * (DK * DV) + dk[:, None] * DV + dv[None, :]
    s = tl.load(at) * tl.load(decay_ptr + bh)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * tl.load(beta_ptr + bh)
    s = s + k[:, None] * delta[None, :]
    tl.store(at, s)
    tl.store(o_ptr + bh * DV + dv, tl.sum(s * q[:, None], axis=0))


def gated_delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                     beta: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``state`` [B, Hv, Dk, Dv] fp32, updated in place: ``S <- decay S``, ``S += k (beta (v - S^T k))^T``; returns
    ``S^T q`` [B, Hv, Dv] fp32. ``q``/``k`` [B, Hk, Dk] fp32 (normalized and scaled; value head h reads key head
    ``h // (Hv / Hk)``), ``v`` [B, Hv, Dv], ``decay`` (= exp(g)) and ``beta`` [B, Hv], all fp32."""
    if not (state.is_cuda or INTERPRETED):
        raise RuntimeError("trace_hf.kernels.gated_delta needs CUDA tensors, or TRITON_INTERPRET=1 (CPU tests).")
    B, HV, DK, DV = state.shape
    HK = q.shape[1]
    if state.dtype != torch.float32 or not state.is_contiguous() or HV % HK or DK & (DK - 1):
        raise ValueError(f"gated_delta_step: state must be contiguous fp32 [B, Hv, Dk, Dv] with Dk a power of two and "
                         f"Hv a multiple of Hk, got {state.dtype} {list(state.shape)} and Hk={HK}.")  # fmt: skip
    bv = min(32, triton.next_power_of_2(DV))
    if DV % bv:
        raise ValueError(f"gated_delta_step: Dv={DV} is not a multiple of {bv}.")
    out = torch.empty(B, HV, DV, dtype=torch.float32, device=state.device)
    args = [t.float().contiguous() for t in (q, k, v, decay, beta)]
    _gated_delta_step_kernel[(B * HV, DV // bv)](state, *args, out, HV, HK, DK=DK, DV=DV, BV=bv, num_warps=4)
    return out
