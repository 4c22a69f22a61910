# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Rotary position embedding of transformers' attention (``apply_rotary_pos_emb``: ``x * cos + rotate_half(x) *
sin`` on the first ``cos.shape[-1]`` channels of each head, the rest passed through) in one launch forward and one
backward, for the training side (`trace_hf.train.rope`).

Why: transformers' version is a product, the halves sliced, negated and concatenated, another product and a sum,
each a pass over q or k (and a concatenation more for Qwen3.5's partial rotary), and autograd's backward as many;
at large token counts that is a leading share of the training side's elementwise glue after the norms. Here a
program rotates every head of one token: x, cos and sin read once, the result written once.

Bit for bit transformers' values, forward and backward: each product and the sum is rounded to the tensor's dtype
as torch rounds it (to nearest even, by bit logic: the interpreter's ``.to(bfloat16)`` truncates), and no FMA
contraction (``enable_fp_fusion=False``). The backward is autograd's: ``g * cos`` plus the partner channel's
``g * sin``, negated for the second half, each product rounded before the sum.
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.rope (see kernels/README.md), not kernels.rope.")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trace_hf.kernels.common import ROUNDED_DTYPES, check_device, round_bf16  # noqa: E402


#: Warps per program (a program holds one token's heads: 32 x 128 for Qwen3-30B-A3B's q).
CONFIG = {"num_warps": 4}


@triton.jit(do_not_specialize=["T"])  # token counts: see kernels/README.md
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, T, H, sxb, sxh, sxt, syb, syh, syt, scb, sct, D: tl.constexpr,
                 R: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, BACKWARD: tl.constexpr, BF16: tl.constexpr):  # fmt: skip
    # x and y [B, H, T, D] by strides (channels contiguous), cos and sin [B, T, R] (channels contiguous).
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    h = tl.arange(0, BH)
    d = tl.arange(0, BD)
    m = (h < H)[:, None] & (d < D)[None, :]
    rot = d < R
    first = d < R // 2
    partner = tl.where(first, d + R // 2, d - R // 2)
    at = x_ptr + b * sxb + t * sxt + h[:, None] * sxh
    x = tl.load(at + d[None, :], mask=m, other=0.0).to(tl.float32)
    xp = tl.load(at + partner[None, :], mask=m & rot[None, :], other=0.0).to(tl.float32)
    cs = b * scb + t * sct
    c = tl.load(cos_ptr + cs + d, mask=rot, other=0.0).to(tl.float32)
    if BACKWARD:  # autograd's: the partner's product with its own sin, + for the first half, - for the second
        s = tl.load(sin_ptr + cs + partner, mask=rot, other=0.0).to(tl.float32)
        sign = tl.where(first, 1.0, -1.0)
    else:  # rotate_half(x) = [-x2, x1]
        s = tl.load(sin_ptr + cs + d, mask=rot, other=0.0).to(tl.float32)
        sign = tl.where(first, -1.0, 1.0)
    y = round_bf16(x * c[None, :], BF16) + sign[None, :] * round_bf16(xp * s[None, :], BF16)
    y = tl.where(rot[None, :], round_bf16(y, BF16), x)
    tl.store(y_ptr + b * syb + t * syt + h[:, None] * syh + d[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool, contiguous: bool) -> torch.Tensor:
    """x [B, H, T, D] (any strides) rotated by cos/sin [B or 1, T, R]; the result contiguous or in x's layout."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    b, h, t, d = x.shape
    r = cos.shape[-1]
    cos, sin = (c.expand(b, t, r) if c.stride(-1) == 1 else c.expand(b, t, r).contiguous() for c in (cos, sin))
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if contiguous else torch.empty_like(x)
    if y.stride(-1) != 1:
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        _rope_kernel[(b * t,)](
            x, cos, sin, y, t, h, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
            cos.stride(0), cos.stride(1), D=d, R=r, BH=triton.next_power_of_2(h), BD=triton.next_power_of_2(d),
            BACKWARD=backward, BF16=x.dtype == torch.bfloat16, num_warps=CONFIG["num_warps"], enable_fp_fusion=False,
        )  # fmt: skip
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, contiguous: bool):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, backward=False, contiguous=contiguous)

    @staticmethod
    def backward(ctx, grad):
        # Contiguous, as autograd's sum of transformers' product and slice gradients is: reductions over it later
        # (the q/k norms' weight gradients) then add in the same order.
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, backward=True, contiguous=True), None, None, None


def supported(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `rope` computes transformers' values for these operands (else call transformers' function)."""
    r = cos.shape[-1]
    return (
        x.dtype in ROUNDED_DTYPES and cos.dtype == x.dtype and r % 2 == 0 and 0 < r <= x.shape[-1] and cos.dim() == 3
    )


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, contiguous: bool = False) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` for one of q/k, with autograd: x [B, H, T, D], cos and sin [B or 1,
    T, R] in x's dtype (bf16 or fp32), R <= D even; channels past R pass through. The result is laid out as x
    (transformers' product and sum), or with ``contiguous`` as [B, H, T, D] (where transformers concatenates the
    passed channels back, Qwen3.5): the attention after it then reads the same layout."""
    check_device(x)
    if not supported(x, cos) or sin.shape != cos.shape or sin.dtype != cos.dtype:
        raise ValueError(
            f"rope takes x [B, H, T, D] and cos/sin [B, T, R] of x's dtype (bf16 or fp32), R even and <= D; got x "
            f"{tuple(x.shape)} {x.dtype}, cos {tuple(cos.shape)} {cos.dtype}, sin {tuple(sin.shape)}: call "
            "transformers' apply_rotary_pos_emb for these."
        )
    return _Rope.apply(x, cos, sin, contiguous)
