# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Small fused kernels of the decode step: residual add + RMSNorm, and the router's softmax + top-k.

At decode sizes every elementwise torch op is its own launch that moves a few KB; a 48-layer step would be made
of thousands of them. These two kernels replace the ~15 launches per layer the plain torch code needs for the
norms and the router (the MoE's top-k slot sum is folded into the next norm's residual add).
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.decode_ops (see kernels/README.md), not kernels.decode_ops.")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trace_hf.kernels.fp4_moe import INTERPRETED  # noqa: E402


@triton.jit
def _add_rmsnorm_kernel(res_ptr, add_ptr, w_ptr, out_ptr, H, eps, NADD: tl.constexpr, BLOCK_H: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    m = h < H
    x = tl.load(res_ptr + r * H + h, mask=m, other=0.0).to(tl.float32)
    if NADD > 0:
        for j in tl.static_range(NADD):
            x += tl.load(add_ptr + (r * NADD + j) * H + h, mask=m, other=0.0).to(tl.float32)
        # The residual stream stays in the model dtype, as in the model: normalize the rounded value.
        x = x.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + r * H + h, x, mask=m)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * tl.load(w_ptr + h, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * H + h, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _router_topk_kernel(
    logits_ptr, ids_ptr, w_ptr, E, K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, NORM: tl.constexpr
):
    r = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    m = e < E
    lg = tl.load(logits_ptr + r * E + e, mask=m, other=float("-inf")).to(tl.float32)
    p = tl.exp(lg - tl.max(lg, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(m, p, -1.0)
    kk = tl.arange(0, K_PAD)
    vals = tl.zeros([K_PAD], tl.float32)
    idx = tl.zeros([K_PAD], tl.int32)
    for k in tl.static_range(K):
        mx = tl.max(p, axis=0)
        i = tl.min(tl.where(p == mx, e, E_PAD), axis=0)  # the lowest index among ties
        vals = tl.where(kk == k, mx, vals)
        idx = tl.where(kk == k, i, idx)
        p = tl.where(e == i, -2.0, p)
    if NORM:
        vals = vals / tl.sum(vals, axis=0)
    tl.store(ids_ptr + r * K + kk, idx, mask=kk < K)
    tl.store(w_ptr + r * K + kk, vals, mask=kk < K)


def _check(t: torch.Tensor) -> None:
    if not (t.is_cuda or INTERPRETED):
        raise RuntimeError("trace_hf.kernels.decode_ops needs CUDA tensors, or TRITON_INTERPRET=1 (CPU tests).")


def add_rmsnorm(
    res: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``res += add.sum(1)`` in place (``add`` [M, n, H], any float dtype; None: no add), then RMSNorm(res) * weight
    in ``res.dtype`` (Qwen3's RMSNorm: fp32 statistics, normalized value rounded to the dtype before the weight)."""
    _check(res)
    M, H = res.shape
    out = torch.empty_like(res) if out is None else out
    nadd = 0 if add is None else add.shape[1]
    _add_rmsnorm_kernel[(M,)](
        res, add.contiguous() if add is not None else res, weight, out, H, eps,
        NADD=nadd, BLOCK_H=triton.next_power_of_2(H), num_warps=4 if H <= 4096 else 8,
    )  # fmt: skip
    return out


def router_topk(logits: torch.Tensor, top_k: int, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (fp32) over the experts, top-k, optionally renormalized: (ids int32 [M, k], weights fp32 [M, k])."""
    _check(logits)
    M, E = logits.shape
    ids = torch.empty(M, top_k, dtype=torch.int32, device=logits.device)
    w = torch.empty(M, top_k, dtype=torch.float32, device=logits.device)
    _router_topk_kernel[(M,)](
        logits.contiguous(), ids, w, E, K=top_k, E_PAD=triton.next_power_of_2(E),
        K_PAD=triton.next_power_of_2(max(top_k, 2)), NORM=normalize, num_warps=4,
    )  # fmt: skip
    return ids, w
