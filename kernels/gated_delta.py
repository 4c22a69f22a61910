# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""One decode token of Gated DeltaNet (Qwen3.5's linear attention) between its projections, in two or three launches.

Why: per token the layer is a few KB of vectors against a [B, Hv, Dk, Dv] fp32 state (2 MB a sequence per layer at
Qwen3.5-35B-A3B's 32 x 128 x 128). transformers' torch step is some 45 launches a layer (the conv window's shift
and product, SiLU, the q/k L2 norms, the gates, six passes over the state, the gated RMSNorm), each a few
microseconds even inside a CUDA graph; at 30 such layers that is milliseconds a step. Here:

* `causal_conv_step`: shift the conv window (static [B, C, kernel] state, in place), the depthwise product, SiLU,
  the q/k L2 norms and q's 1/sqrt(Dk): q, k and v as one fp32 row [B, C] (channel order of the projection).
* `gated_delta_step`: the gates (beta = sigmoid(b), decay = exp(-exp(A_log) softplus(a + dt_bias))), the rule
  (``S <- decay S``, ``S += k (beta (v - S^T k))^T``, ``o = S^T q``: the state read once and written once) and the
  gated RMSNorm (``w * norm(o) * silu(z)``): the out projection's input [B, Hv * Dv] in the model dtype. The rule
  is bound by the state's bytes, and programs over slices of a head's value columns stream it faster than one
  program per head; the norm, which needs the whole head, is then a third small launch (`CONFIG`).

Each value is rounded where transformers' torch path rounds it (conv and SiLU outputs, beta, the rule's output,
the normalized and weighted values), so the two agree up to fp32 summation order and ``exp``'s last bits. They run
under the CPU interpreter (CI) and in CUDA graphs on any Triton, which is why they are not flash-linear-attention's
``fused_recurrent_gated_delta_rule`` (its kernels are gated on Triton versions) or causal-conv1d (a CUDA extension).
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.gated_delta (see kernels/README.md), not kernels.gated_delta.")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trace_hf.kernels.common import INTERPRETED  # noqa: E402


@triton.jit
def _conv_step_kernel(proj_ptr, proj_stride, st_ptr, w_ptr, qkv_ptr, HK, HV, q_scale, DK: tl.constexpr,
                      DV: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # One program per (row, head slot): slots 0..HK-1 are q heads, HK..2HK-1 k heads, the rest v heads, in the
    # projection's channel order [q | k | v].
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    C = 2 * HK * DK + HV * DV
    is_v = j >= 2 * HK
    c0 = tl.where(is_v, 2 * HK * DK + (j - 2 * HK) * DV, j * DK)
    i = tl.arange(0, BLOCK)
    m = i < tl.where(is_v, DV, DK)
    c = c0 + i
    t = tl.arange(0, KP)[None, :]
    mk = m[:, None] & (t < K)
    at = st_ptr + (b * C + c)[:, None] * K + t
    # The window after the shift: the state's last K - 1 inputs, then this token's.
    old = tl.load(at + 1, mask=m[:, None] & (t < K - 1), other=0.0)
    new = tl.load(proj_ptr + b * proj_stride + c, mask=m, other=0.0).to(old.dtype)
    win = tl.where(t == K - 1, new[:, None], old)
    tl.debug_barrier()  # every load of the old window before any store of the new one
    tl.store(at, win, mask=mk)
    w = tl.load(w_ptr + c[:, None] * K + t, mask=mk, other=0.0)
    x = tl.sum(win.to(tl.float32) * w.to(tl.float32), axis=1).to(w.dtype).to(tl.float32)  # conv1d, in its dtype
    x = (x / (1.0 + tl.exp(-x))).to(w.dtype).to(proj_ptr.dtype.element_ty).to(tl.float32)  # SiLU, rounded
    if j < 2 * HK:  # q or k: L2 norm over the head (transformers' eps 1e-6), q also times 1/sqrt(Dk)
        x = x * (1.0 / tl.sqrt(tl.sum(tl.where(m, x * x, 0.0)) + 1e-6))
        if j < HK:
            x = x * q_scale
    tl.store(qkv_ptr + b * C + c, x, mask=m)


#: Launch of the rule: ``block_v`` value columns of a head per program. Below Dv, more programs with smaller state
#: tiles, and the gated norm (which needs the whole head) runs as a second launch; at Dv, the norm follows in the
#: same program. ``num_warps`` per program. The best of `benchmarks/kernels/gated_delta_tune.py` on the H200
#: (docs/lab-notes.md 7d, Qwen3.5-35B-A3B's heads, rule and norm launches together): 77, 282 and 418 us at 64, 256 and
#: 384 rows, 82-91% of copy bandwidth (32 columns with 4 warps, the earlier kernel's shape: 85, 320, 476 us; the whole
#: head in one program with 4 warps: 78, 287, 430 us).
CONFIG = {"block_v": 64, "num_warps": 2}


@triton.jit
def _gated_norm(o, dv, row, z_off, h, nw_ptr, eps, DV: tl.constexpr, dt: tl.constexpr):
    """The gated RMSNorm of one head's rule output ``o`` (already rounded to ``dt``): normalize in fp32, round,
    times its weight (rounded), times silu(z) in fp32, rounded."""
    n = (o * (1.0 / tl.sqrt(tl.sum(o * o) / DV + eps))).to(dt).to(tl.float32)
    g = (tl.load(nw_ptr + dv).to(tl.float32) * n).to(dt).to(tl.float32)
    z = tl.load(row + z_off + h * DV + dv).to(tl.float32)
    return (g * (z / (1.0 + tl.exp(-z)))).to(dt)


@triton.jit
def _delta_rule_kernel(s_ptr, qkv_ptr, proj_ptr, proj_stride, a_log_ptr, dt_bias_ptr, nw_ptr, out_ptr, HK, HV, eps,
                       z_off, b_off, a_off, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)  # row * HV + value head
    b, h = bh // HV, bh % HV
    kh = h // (HV // HK)  # value head h reads key head h // (Hv / Hk), as repeat_interleave
    C = 2 * HK * DK + HV * DV
    dk = tl.arange(0, DK)
    dv = tl.program_id(1) * BV + tl.arange(0, BV)
    q = tl.load(qkv_ptr + b * C + kh * DK + dk)
    k = tl.load(qkv_ptr + b * C + HK * DK + kh * DK + dk)
    v = tl.load(qkv_ptr + b * C + 2 * HK * DK + h * DV + dv)
    row = proj_ptr + b * proj_stride
    dt = proj_ptr.dtype.element_ty
    bb = tl.load(row + b_off + h).to(tl.float32)
    beta = (1.0 / (1.0 + tl.exp(-bb))).to(dt).to(tl.float32)  # sigmoid in the model dtype, then fp32
    x = tl.load(row + a_off + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    u = tl.exp(tl.minimum(x, 20.0))
    w1 = 1.0 + u
    log1p = tl.where(w1 == 1.0, u, tl.log(w1) * (u / tl.where(w1 == 1.0, 1.0, w1 - 1.0)))  # log1p(u), to rounding
    softplus = tl.where(x > 20.0, x, log1p)  # torch's softplus: beta 1, threshold 20
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus)
    at = s_ptr + bh * (DK * DV) + dk[:, None] * DV + dv[None, :]
    s = tl.load(at) * decay
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(at, s)
    o = tl.sum(s * q[:, None], axis=0).to(dt)
    if BV == DV:
        o = _gated_norm(o.to(tl.float32), dv, row, z_off, h, nw_ptr, eps, DV, dt)
    tl.store(out_ptr + bh * DV + dv, o)


@triton.jit
def _gated_norm_kernel(o_ptr, proj_ptr, proj_stride, nw_ptr, HV, eps, z_off, DV: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // HV, bh % HV
    dv = tl.arange(0, DV)
    at = o_ptr + bh * DV + dv
    o = tl.load(at).to(tl.float32)
    tl.store(at, _gated_norm(o, dv, proj_ptr + b * proj_stride, z_off, h, nw_ptr, eps, DV, o_ptr.dtype.element_ty))


def _check_device(*tensors: torch.Tensor) -> None:
    if not (all(t.is_cuda for t in tensors) or INTERPRETED):
        raise RuntimeError("trace_hf.kernels.gated_delta needs CUDA tensors, or TRITON_INTERPRET=1 (CPU tests).")


def causal_conv_step(
    proj: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor, heads: tuple
) -> torch.Tensor:
    """``proj`` [B, N] (the input projection; its first C = 2 Hk Dk + Hv Dv channels are the conv's input),
    ``conv_state`` [B, C, kernel] (updated in place: the window shifted by this token), ``conv_weight`` [C, kernel],
    ``heads`` (Hk, Dk, Hv, Dv). Returns SiLU(conv) as fp32 [B, C]: q (L2-normalized, times 1/sqrt(Dk)), k
    (L2-normalized), v."""
    _check_device(proj, conv_state, conv_weight)
    hk, dk, hv, dv = heads
    B, C, K = conv_state.shape
    if 2 * hk * dk + hv * dv != C or proj.shape[1] < C or conv_weight.shape != (C, K) or proj.stride(1) != 1 \
            or not (conv_state.is_contiguous() and conv_weight.is_contiguous()):  # fmt: skip
        raise ValueError(f"causal_conv_step: conv_state must be contiguous [B, 2 Hk Dk + Hv Dv, kernel] with "
                         f"(Hk, Dk, Hv, Dv) = {heads}, conv_weight contiguous [C, kernel] and proj [B, >= C] with unit "
                         f"column stride; got {list(conv_state.shape)}, {list(conv_weight.shape)}, "
                         f"{list(proj.shape)}.")  # fmt: skip
    qkv = torch.empty(B, C, dtype=torch.float32, device=proj.device)
    block = triton.next_power_of_2(max(dk, dv))
    _conv_step_kernel[(B, 2 * hk + hv)](proj, proj.stride(0), conv_state, conv_weight, qkv, hk, hv, dk**-0.5, DK=dk,
                                        DV=dv, K=K, KP=triton.next_power_of_2(K), BLOCK=block,
                                        num_warps=4, enable_fp_fusion=True)  # fmt: skip
    return qkv


def gated_delta_step(state: torch.Tensor, qkv: torch.Tensor, proj: torch.Tensor, a_log: torch.Tensor,
                     dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, num_k_heads: int) -> torch.Tensor:  # fmt: skip
    """``state`` [B, Hv, Dk, Dv] fp32, updated in place by one token of the gated delta rule; ``qkv`` from
    `causal_conv_step`; ``proj`` [B, C + Hv Dv + 2 Hv], the input projection [qkv | z | b | a] (z, b
    and a read here); ``a_log``, ``dt_bias`` [Hv]; ``norm_weight`` [Dv] the gated RMSNorm's. Returns
    ``norm(o) * weight * silu(z)`` [B, Hv * Dv] in ``proj``'s dtype, the out projection's input."""
    _check_device(state, qkv, proj)
    B, hv, dk, dv = state.shape
    hk = num_k_heads
    C = 2 * hk * dk + hv * dv
    if state.dtype != torch.float32 or not state.is_contiguous() or hv % hk or dk & (dk - 1) or dv & (dv - 1):
        raise ValueError(f"gated_delta_step: state must be contiguous fp32 [B, Hv, Dk, Dv] with Dk and Dv powers of "
                         f"two and Hv a multiple of Hk, got {state.dtype} {list(state.shape)} and Hk={hk}.")  # fmt: skip
    if (
        qkv.shape != (B, C)
        or qkv.dtype != torch.float32
        or proj.shape != (B, C + hv * dv + 2 * hv)
        or proj.stride(1) != 1
    ):
        raise ValueError(f"gated_delta_step: qkv must be fp32 [B, {C}] (causal_conv_step's) and proj [B, "
                         f"{C + hv * dv + 2 * hv}] = [qkv | z | b | a] with unit column stride; got {list(qkv.shape)} "
                         f"{qkv.dtype} and {list(proj.shape)}.")  # fmt: skip
    for name, t, n in (("a_log", a_log, hv), ("dt_bias", dt_bias, hv), ("norm_weight", norm_weight, dv)):
        if t.shape != (n,) or not t.is_contiguous():
            raise ValueError(f"gated_delta_step: {name} must be contiguous [{n}], got {list(t.shape)}.")
    out = torch.empty(B, hv * dv, dtype=proj.dtype, device=proj.device)
    bv = min(CONFIG["block_v"], dv)
    if bv & (bv - 1) or bv < 1:
        raise ValueError(f"gated_delta.CONFIG['block_v'] = {CONFIG['block_v']}: set a power of two.")
    _delta_rule_kernel[(B * hv, dv // bv)](state, qkv, proj, proj.stride(0), a_log, dt_bias, norm_weight, out, hk, hv,
                                           eps, C, C + hv * dv, C + hv * dv + hv, DK=dk, DV=dv, BV=bv,
                                           num_warps=CONFIG["num_warps"], enable_fp_fusion=True)  # fmt: skip
    if bv < dv:  # the norm needs the whole head: its own launch, in place on the rule's rounded output
        _gated_norm_kernel[(B * hv,)](out, proj, proj.stride(0), norm_weight, hv, eps, C, DV=dv, num_warps=1,
                                      enable_fp_fusion=True)  # fmt: skip
    return out
