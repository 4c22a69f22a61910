# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Training's quantization at a hinted site in one pass: `trace_hf.fp4.hinted_quantize`, bit for bit.

A training forward quantizes each hinted activation twice, nearest with its own scales and guided by the rollout's
hints, then keeps one per row and counts where they differ (the flips). Composed from `fp4_quant`'s kernels that is
two launches, two code unpacks, a comparison and three selects, about twenty launches and six passes over the
activation per hinted layer. `_hinted_kernel` loads each whole row once, rounds every value both ways in registers,
and writes the kept codes and scales (or their dequantized values) and the row's flip count.

The arithmetic is `fp4_quant._fp4_kernel`'s, through the same pieces: nearest as its row-scale mode, guided as its
guided mode (the rollout's block-scale byte, NaN for a block holding a non-finite value, its row scale, its bits).
Whole rows per program: rows wider than ``fp4_quant.CONFIG["max_row"]`` take the composed kernels instead.
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("kernels/ is the package trace_hf.kernels: import trace_hf.kernels.fp4_hinted.")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trace_hf import fp4  # noqa: E402
from trace_hf.fp4 import FP4Hints, FP4Tensor  # noqa: E402
from trace_hf.kernels.common import (  # noqa: E402
    bits_of,
    check_device,
    e2m1_nearest,
    e4m3_decode,
    float_of,
    is_finite,
    nvfp4_block_scale,
)
from trace_hf.kernels.fp4_quant import (  # noqa: E402
    _BF16,
    CONFIG,
    _as_input,
    _e8m0_decode,
    _hint_tensors,
    _load_f32,
    _nvfp4_row_global,
    _out_kind,
    _scaled_magnitude,
    _store_codes,
    _tiles,
    guided_index,
    mxfp4_block_scale,
    store_values,
)


@triton.jit(do_not_specialize=["M"])  # token counts: see kernels/README.md
def _hinted_kernel(
    x_ptr,
    has_ptr,  # [M] uint8: the row has a hint
    hsb_ptr,  # the hints' block-scale bytes [M, K / BS]
    hb_ptr,  # the hints' mantissa bits [M, K / 8]
    hg_ptr,  # the hints' row scale [M]
    q_ptr,  # packed codes [M, K / 2] (WRITE_Q)
    sb_ptr,  # block-scale bytes [M, K / BS] (WRITE_Q)
    g_ptr,  # row scale [M] (WRITE_Q)
    out_ptr,  # dequantized values [M, K] (WRITE_OUT)
    flips_ptr,  # [M] int32
    M,
    K,
    APPLY: tl.constexpr,
    NVFP4: tl.constexpr,
    IN_KIND: tl.constexpr,
    OUT_KIND: tl.constexpr,
    WRITE_Q: tl.constexpr,
    WRITE_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BS: tl.constexpr,
):
    # [BLOCK_M, NBT, BS]: whole rows (BLOCK_K >= K) x scale blocks x elements, as `_fp4_kernel`'s row mode.
    NBT: tl.constexpr = BLOCK_K // BS
    NB = K // BS
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    blks = tl.arange(0, NBT)
    row64 = rows.to(tl.int64)
    row_ok = rows < M
    bmask = row_ok[:, None] & (blks < NB)[None, :]
    mask = bmask[:, :, None]
    e = tl.arange(0, BS)[None, None, :]
    base = (row64 * K)[:, None, None]
    x = _load_f32(x_ptr + base, blks[None, :, None] * BS + e, mask, IN_KIND)
    xb = bits_of(x)
    sign = (xb >> 28) & 8
    amax_i = tl.max(xb & 0x7FFFFFFF, axis=2)
    amax_b = float_of(amax_i)
    bad_b = amax_i >= 0x7F800000

    # ---- nearest, with the training's own scales ----------------------------------------------------------
    if NVFP4:
        g_n = _nvfp4_row_global(amax_i)[:, None]
        sbyte_n, s_n, sg_n, ok_n = nvfp4_block_scale(amax_b, g_n)
    else:
        sbyte_n, s_n, ok_n = mxfp4_block_scale(amax_b, bad_b)
        g_n = tl.full([BLOCK_M, 1], 1.0, tl.float32)
        sg_n = s_n
    a, _ = _scaled_magnitude(x, sg_n, ok_n)
    code_n = tl.where(ok_n[:, :, None], e2m1_nearest(a), 0) | sign

    # ---- guided, with the rollout's scales and bits -----------------------------------------------------
    has = tl.load(has_ptr + rows, mask=row_ok, other=0) != 0
    hmask = bmask & has[:, None]
    sbyte_h = tl.load(hsb_ptr + (row64 * NB)[:, None] + blks[None, :], mask=hmask, other=0).to(tl.int32) & 0xFF
    g_h = tl.load(hg_ptr + rows, mask=row_ok & has, other=1.0)[:, None]
    # A non-finite training value poisons its block: the NaN scale byte, as `guided_quantize`.
    if NVFP4:
        sbyte_h = tl.where(bad_b, 0x7F, sbyte_h)
        s_h = e4m3_decode(sbyte_h)
    else:
        sbyte_h = tl.where(bad_b, 0xFF, sbyte_h)
        s_h = _e8m0_decode(sbyte_h)
    sg_h = s_h * g_h
    ok_h = is_finite(sg_h) & (sg_h > 0)
    a, d = _scaled_magnitude(x, sg_h, ok_h)
    idx = guided_index(x, a, d, hb_ptr, row64, blks, K, hmask[:, :, None], BLOCK_M, NBT, BS)
    code_h = tl.where(ok_h[:, :, None], idx, 0) | sign

    # ---- flips, and the rows' choice --------------------------------------------------------------------
    flip = (code_n != code_h) & (((code_n | code_h) & 7) != 0) & mask & has[:, None, None]
    tl.store(flips_ptr + rows, tl.sum(tl.sum(flip.to(tl.int32), axis=2), axis=1), mask=row_ok)
    if APPLY:
        use = has[:, None]
        code = tl.where(use[:, :, None], code_h, code_n)
        sbyte = tl.where(use, sbyte_h, sbyte_n)
        s = tl.where(use, s_h, s_n)
        g = tl.where(use, g_h, g_n)
    else:
        code, sbyte, s, g = code_n, sbyte_n, s_n, g_n

    if WRITE_Q:
        _store_codes(q_ptr, code, row64, blks, K, mask, BLOCK_M, NBT, BS)
        tl.store(sb_ptr + (row64 * NB)[:, None] + blks[None, :], sbyte.to(tl.uint8), mask=bmask)
        tl.store(g_ptr + rows, tl.sum(g, axis=1), mask=row_ok)
    if WRITE_OUT:
        store_values(out_ptr + base + blks[None, :, None] * BS + e, code, s, g, mask, OUT_KIND)


def _launch(x, hints, has, apply, write_q, out):
    f = fp4.get_format(hints.fmt)
    x2, kind = _as_input(x)
    M, K = x2.shape
    sb_h, hb, g_h = _hint_tensors(x, hints)
    has_u8 = has.reshape(-1).contiguous().view(torch.uint8)
    dev = x.device
    packed = torch.empty(M, K // 2, dtype=torch.uint8, device=dev) if write_q else None
    sb = torch.empty(M, K // f.block_size, dtype=torch.uint8, device=dev) if write_q else None
    g = torch.empty(M, dtype=torch.float32, device=dev) if write_q else None
    flips = torch.empty(M, dtype=torch.int32, device=dev)
    out_kind = _out_kind(out.dtype) if out is not None else 0
    block_m, block_k, _, warps = _tiles(M, K, f.block_size, True, "guided_fake")
    dummy = x2
    _hinted_kernel[(triton.cdiv(M, block_m),)](
        x2, has_u8, sb_h, hb, g_h,
        packed if write_q else dummy, sb if write_q else dummy, g if write_q else dummy,
        (out.view(torch.int16) if out_kind == _BF16 else out) if out is not None else dummy,
        flips, M, K,
        APPLY=apply, NVFP4=f.has_global_scale, IN_KIND=kind, OUT_KIND=out_kind, WRITE_Q=write_q,
        WRITE_OUT=out is not None, BLOCK_M=block_m, BLOCK_K=block_k, BS=f.block_size,
        num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    lead = x.shape[:-1]
    q = None
    if write_q:
        q = FP4Tensor(packed.view(*lead, K // 2), sb.view(*lead, -1), g.view(*lead, 1), f.name)
    return q, flips.sum()


def _one_pass(x: torch.Tensor) -> bool:
    return x.numel() > 0 and triton.next_power_of_2(x.shape[-1]) <= CONFIG["max_row"]


def hinted_quantize(x: torch.Tensor, hints: FP4Hints, has: torch.Tensor, apply: bool = True):
    """`trace_hf.fp4.hinted_quantize`: (codes, flips)."""
    check_device(x)
    if not _one_pass(x):
        return fp4.compose_hinted(x, hints, has, apply, backend="torch" if x.numel() == 0 else "triton")
    return _launch(x, hints, has, apply, True, None)


def hinted_fake_quantize(x: torch.Tensor, hints: FP4Hints, has: torch.Tensor, apply: bool = True):
    """`trace_hf.fp4.hinted_fake_quantize`: (values in ``x.dtype``, flips)."""
    check_device(x)
    if not _one_pass(x):
        q, flips = hinted_quantize(x, hints, has, apply)
        return q.dequantize(x.dtype), flips
    out_kind = _out_kind(x.dtype)
    out = torch.empty(x.shape, dtype=torch.bfloat16 if out_kind == _BF16 else torch.float32, device=x.device)
    _, flips = _launch(x, hints, has, apply, False, out)
    return (out if out.dtype == x.dtype else out.to(x.dtype)), flips
