# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Gated DeltaNet's recurrent rule over whole sequences: the values of training forwards under
``TraceGRPOConfig(gated_delta_rule="recurrent")`` (`trace_hf.train.delta_rule`) in one launch per layer call.

Why: transformers' torch recurrent rule is a Python loop over tokens of about ten launches each, so a 1,152-token
micro-batch costs some 11K launches per layer, which made the recurrent values too slow to be worth their lower
rollout/training mismatch. Here one program per (row, value head, slice of value columns) keeps its [Dk, BV] slice of
the fp32 state in registers for the whole sequence and makes one pass over it per token.

The inputs are prepared by transformers' own torch ops (head repetition, the q/k L2 norms, q's 1/sqrt(Dk), the
decay's ``exp``), and the state update is the engine's decode step's (`gated_delta._delta_rule_kernel`, with the
same value-column slices, ``gated_delta.CONFIG["block_v"]``): so the values are transformers' torch rule's up to the
fp32 summation order of the two sums over Dk, as the engine's decode step's are.
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.gated_delta_recurrent (see kernels/README.md), not kernels.*.")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trace_hf.kernels.common import check_device  # noqa: E402
from trace_hf.kernels.gated_delta import CONFIG as STEP_CONFIG  # noqa: E402


#: Warps per program: the [Dk, BV] state slice stays in registers for the whole sequence (128 x 64 fp32 at
#: Qwen3.5's shape: 64 registers a thread at 4 warps, 128 at the decode step's 2).
CONFIG = {"num_warps": 4}


@triton.jit
def _recurrent_rule_kernel(q_ptr, k_ptr, v_ptr, decay_ptr, beta_ptr, s_ptr, o_ptr, T, DK: tl.constexpr,
                           DV: tl.constexpr, BV: tl.constexpr, HAS_STATE: tl.constexpr, KEEP_STATE: tl.constexpr):  # fmt: skip
    # q, k [B * H, T, DK], v and o [B * H, T, DV], decay and beta [B * H, T], all fp32 contiguous; state [B * H, DK, DV].
    bh = tl.program_id(0).to(tl.int64)
    dk = tl.arange(0, DK)
    dv = tl.program_id(1) * BV + tl.arange(0, BV)
    at = s_ptr + bh * (DK * DV) + dk[:, None] * DV + dv[None, :]
    if HAS_STATE:
        s = tl.load(at)
    else:
        s = tl.zeros((DK, BV), dtype=tl.float32)
    for t in range(T):
        row = bh * T + t
        q = tl.load(q_ptr + row * DK + dk)
        k = tl.load(k_ptr + row * DK + dk)
        v = tl.load(v_ptr + row * DV + dv)
        s = s * tl.load(decay_ptr + row)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * tl.load(beta_ptr + row)
        s = s + k[:, None] * delta[None, :]
        tl.store(o_ptr + row * DV + dv, tl.sum(s * q[:, None], axis=0))
    if KEEP_STATE:
        tl.store(at, s)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)  # transformers' (and fla's) l2norm


def recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, **kwargs):  # fmt: skip
    """transformers' ``torch_recurrent_gated_delta_rule`` (same arguments: ``query``/``key`` [B, T, Hk, Dk],
    ``value`` [B, T, Hv, Dv], ``g`` (log decay) and ``beta`` [B, T, Hv]; same returns: the output [B, T, Hv, Dv] in
    the input's dtype and the final fp32 state [B, Hv, Dk, Dv] or None) with the loop over tokens in one launch."""
    check_device(query)
    dtype = query.dtype
    B, T, hk, dk = key.shape
    hv, dv = value.shape[-2:]
    if hv % hk or dk & (dk - 1) or dv & (dv - 1):
        raise ValueError(f"recurrent_gated_delta_rule: Dk and Dv must be powers of two and Hv a multiple of Hk; got "
                         f"Hk={hk}, Dk={dk}, Hv={hv}, Dv={dv}.")  # fmt: skip
    if hk != hv:
        query = query.repeat_interleave(hv // hk, dim=2)
        key = key.repeat_interleave(hv // hk, dim=2)
    # [B, H, T, ...] fp32, contiguous (`to` alone keeps an fp32 input's transposed strides)
    query, key, value, beta, g = (
        x.transpose(1, 2).to(torch.float32).contiguous() for x in (query, key, value, beta, g)
    )
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query / (dk**0.5)
    decay = g.exp()
    state = None
    if initial_state is not None or output_final_state:
        state = torch.zeros(B, hv, dk, dv, dtype=torch.float32, device=value.device)
        if initial_state is not None:
            state.copy_(initial_state)
    out = torch.empty_like(value)
    bv = min(STEP_CONFIG["block_v"], dv)
    _recurrent_rule_kernel[(B * hv, dv // bv)](query, key, value, decay, beta, out if state is None else state, out,
                                               T, DK=dk, DV=dv, BV=bv, HAS_STATE=initial_state is not None,
                                               KEEP_STATE=output_final_state, num_warps=CONFIG["num_warps"])  # fmt: skip
    return out.transpose(1, 2).contiguous().to(dtype), state if output_final_state else None
