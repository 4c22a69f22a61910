# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""RMSNorm of transformers' decoder layers in one launch forward and one backward, for the training side
(`trace_hf.train.rms_norm.FusedRMSNorm`).

Why: transformers' RMSNorm is an fp32 copy, ``pow``, ``mean``, ``rsqrt`` and three products forward, and autograd
runs about a dozen fp32 elementwise and reduction kernels back; a Qwen3 MoE layer has four of them (input, post-attention,
and q/k per head), so at large token counts they are a leading share of the training side's elementwise glue. Here a
program normalizes a block of rows in registers: it reads the input once and writes the output (and one fp32 rstd per
row) once; the backward reads the input, the output's gradient and rstd and writes the input's gradient, plus one
fp32 partial sum per program for the weight's gradient where the weight trains.

Both weight forms transformers uses: ``weight * x̂.to(dtype)`` (Llama, Qwen3 MoE; ``zero_centered=False``) and
``(x̂ * (1 + weight.float())).to(dtype)`` (Qwen3.5, Qwen3-Next). Every rounding transformers' ops do is done here
too, to nearest even (by bit logic: the interpreter's ``.to(bfloat16)`` truncates), so the values are transformers'
up to the fp32 summation order of the row's sum of squares: a bf16 output can move by one unit in the last place
where ``x * rstd`` lies within a few fp32 units of a bf16 rounding boundary.
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.rms_norm (see kernels/README.md), not kernels.rms_norm.")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trace_hf.kernels.common import ROUNDED_DTYPES, check_device, round_bf16  # noqa: E402


#: Elements a program holds (its rows times the padded row width): one or two rows of the hidden size, or 32 rows of
#: a 128-wide head norm; and warps per program (more for rows wider than 2,048: 512 elements a warp at most).
CONFIG = {"block": 4096, "num_warps": 4}


@triton.jit(do_not_specialize=["R"])  # token counts: see kernels/README.md
def _forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, R, N, inv_n, eps, ZERO_CENTERED: tl.constexpr, X_BF16: tl.constexpr,
                    Y_BF16: tl.constexpr, ROWS: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BN)
    m = (rows < R)[:, None] & (cols < N)[None, :]
    at = rows[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=1) * inv_n + eps))  # torch's mean: the sum times 1/N
    xhat = x * rstd[:, None]
    if ZERO_CENTERED:
        y = xhat * (1.0 + w)[None, :]
    else:
        y = round_bf16(xhat, X_BF16) * w[None, :]
    tl.store(y_ptr + at, round_bf16(y, Y_BF16).to(y_ptr.dtype.element_ty), mask=m)
    tl.store(rstd_ptr + rows, rstd, mask=rows < R)


@triton.jit(do_not_specialize=["R"])  # token counts: see kernels/README.md
def _backward_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, R, N, inv_n, ZERO_CENTERED: tl.constexpr,
                     X_BF16: tl.constexpr, Y_BF16: tl.constexpr, HAS_DW: tl.constexpr, ROWS: tl.constexpr,
                     BN: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BN)
    m = (rows < R)[:, None] & (cols < N)[None, :]
    at = rows[:, None] * N + cols[None, :]
    dy = tl.load(dy_ptr + at, mask=m, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=rows < R, other=0.0)[:, None]
    xhat = x * rstd
    if ZERO_CENTERED:
        g = dy * (1.0 + w)[None, :]
        dw = dy * xhat
    else:
        g = round_bf16(dy * w[None, :], Y_BF16)  # autograd's product of the output's gradient and the weight, rounded
        dw = dy * round_bf16(xhat, X_BF16)
    # d/dx of x * (mean(x^2) + eps)^-1/2: g * rstd - x * rstd^3 * mean(g * x).
    s = (tl.sum(g * x, axis=1) * inv_n)[:, None]
    dx = g * rstd - x * (rstd * rstd * rstd * s)
    tl.store(dx_ptr + at, round_bf16(dx, X_BF16).to(dx_ptr.dtype.element_ty), mask=m)
    if HAS_DW:
        tl.store(dw_ptr + pid * N + cols, tl.sum(dw, axis=0), mask=cols < N)


def _launch(n: int) -> tuple[int, int, int]:
    """(rows per program, padded row width, warps) for rows of ``n``."""
    bn = triton.next_power_of_2(n)
    return max(1, CONFIG["block"] // bn), bn, max(CONFIG["num_warps"], min(16, bn // 512))


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_device(x)
    if x.dtype not in ROUNDED_DTYPES or weight.dtype not in ROUNDED_DTYPES:
        raise ValueError(f"rms_norm takes bf16 or fp32 inputs and weights, got {x.dtype} and {weight.dtype}: use "
                         "transformers' RMSNorm for other dtypes.")  # fmt: skip
    if weight.dim() != 1 or x.shape[-1] != weight.numel():
        raise ValueError(
            f"rms_norm normalizes the last dimension: input {tuple(x.shape)}, weight {tuple(weight.shape)}."
        )


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, zero_centered: bool):
        n = x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        out_dtype = x.dtype if zero_centered else torch.promote_types(weight.dtype, x.dtype)
        y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        rows, bn, warps = _launch(n)
        if x2.shape[0]:
            _forward_kernel[(triton.cdiv(x2.shape[0], rows),)](
                x2, weight, y, rstd, x2.shape[0], n, 1.0 / n, float(eps), ZERO_CENTERED=zero_centered,
                X_BF16=x.dtype == torch.bfloat16, Y_BF16=out_dtype == torch.bfloat16, ROWS=rows, BN=bn,
                num_warps=warps, enable_fp_fusion=True,
            )  # fmt: skip
        ctx.save_for_backward(x2, weight, rstd)
        ctx.zero_centered = zero_centered
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        r, n = x2.shape
        rows, bn, warps = _launch(n)
        grid = triton.cdiv(r, rows)
        has_dw = ctx.needs_input_grad[1]
        dx = torch.empty_like(x2)
        dw = torch.empty((grid, n), dtype=torch.float32, device=x2.device) if has_dw else rstd
        if r:
            _backward_kernel[(grid,)](
                dy.reshape(r, n).contiguous(), x2, weight, rstd, dx, dw, r, n, 1.0 / n, ZERO_CENTERED=ctx.zero_centered,
                X_BF16=x2.dtype == torch.bfloat16, Y_BF16=dy.dtype == torch.bfloat16, HAS_DW=has_dw, ROWS=rows,
                BN=bn, num_warps=warps, enable_fp_fusion=True,
            )  # fmt: skip
        dweight = dw.sum(0).to(weight.dtype) if has_dw else None
        return dx.view(ctx.shape), dweight, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension with autograd: ``weight * x̂.to(x.dtype)``, or with ``zero_centered``
    ``(x̂ * (1 + weight.float())).to(x.dtype)``, where ``x̂ = x * rsqrt(mean(x^2) + eps)`` in fp32."""
    _check(x, weight)
    return _RMSNorm.apply(x, weight, eps, zero_centered)
