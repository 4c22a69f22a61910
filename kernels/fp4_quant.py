# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Triton kernels for the FP4 formats of `trace_hf.fp4`, bit for bit.

Public: `quantize` (optionally with the hints, in the same pass), `dequantize`, `guided_quantize` and
`fake_quantize`. They take CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` was set before triton was
imported (tests). `trace_hf.fp4` calls them for ``backend="triton"`` (and ``"auto"`` on CUDA).

One kernel (`_fp4_kernel`) covers nearest quantization, hint-guided quantization and fused fake quantization,
for NVFP4 and MXFP4: a program loads a tile of ``BLOCK_M`` rows x ``BLOCK_K`` columns (blocks of ``BS``), works
out the scales, rounds every element once, and writes whatever the caller asked for (packed codes, scale bytes, the
row's global scale, the mantissa bits of the hints, the dequantized values). `_dequant_kernel` decodes a packed
tensor and `_row_amax_kernel` feeds the per-expert / per-tensor global scales.

Why the arithmetic looks the way it does (docs/numerics.md, the kernel contract):

* every fp32 division is ``tl.div_rn`` (Triton's ``/`` is not IEEE on the GPU), or, per element in `_fp4_kernel`,
  an exact branch-free Markstein iteration on a per-block ``div_rn`` reciprocal (explained there);
* kernels launch with ``enable_fp_fusion=False`` so that no product is contracted into an FMA;
* E2M1 and E4M3 rounding, E4M3/E8M0/E2M1 decoding and the bf16 output rounding are integer or comparison logic
  on the fp32 bits: the interpreter's float casts (fp8, bf16) do not round like the GPU;
* bf16 inputs are widened from their bits (exact on both), never through a float cast;
* signs are masked off before right shifts (the interpreter shifts int32 arithmetically for both kinds);
* NaN payloads are not part of the contract (torch's own differ by device and even by vector width): a NaN
  stays a NaN wherever the reference has one, every other bit is the reference's.
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError(
        "kernels/ is the package trace_hf.kernels (installed from this folder via package-dir); import "
        "trace_hf.kernels.fp4_quant. The top-level name `kernels` belongs to the Hugging Face Kernels package, "
        "which transformers probes for: run from an install (pip install -e .), and `pytest`, not `python -m pytest`."
    )

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trace_hf import fp4  # noqa: E402
from trace_hf.fp4 import FP4Hints, FP4Tensor, check_hints, check_input, check_scale  # noqa: E402
from trace_hf.kernels.common import (  # noqa: E402
    INTERPRETED,
    bits_of,
    check_device,
    e2m1_decode,
    e2m1_nearest,
    e4m3_decode,
    float_of,
    is_finite,
    nvfp4_block_scale,
)


# Input and output element kinds (constexpr switches).
_F32, _BF16, _F16 = 0, 1, 2
# What a launch of `_fp4_kernel` rounds with.
_MODE_ROW = 0  # nearest, NVFP4 global scale taken over each row in the kernel (MXFP4: no global scale)
_MODE_GIVEN_G = 1  # nearest, NVFP4 global scale given per group of rows (expert / tensor)
_MODE_GUIDED = 2  # guided by hints: block scales, global scale and mantissa bits given


# ----------------------------------------------------------------------------------------------------------
# Scalar formats, as bit logic
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _load_f32(ptr, offs, mask, IN_KIND: tl.constexpr):
    if IN_KIND == 1:
        # bf16 arrives as int16 bits: widening by a shift is exact, a float cast is not under the interpreter.
        b = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return float_of(b << 16)
    else:
        return tl.load(ptr + offs, mask=mask, other=0).to(tl.float32)


@triton.jit
def _e2m1_guided(a, bit):
    """Of the two grid neighbours of 0 <= a <= 6, the one whose mantissa bit (index & 1) is ``bit``; a value on the
    grid stays. Floor index and "on the grid" come from the bits as in `e2m1_nearest`."""
    u = bits_of(a)
    small = a < 1.0
    lo = tl.where(small, (a >= 0.5).to(tl.int32), (u >> 22) - 252)
    on_grid = tl.where(small, (a == 0.0) | (a == 0.5), (u & 0x3FFFFF) == 0)
    return tl.where(on_grid, lo, lo + ((lo ^ bit) & 1))


@triton.jit
def _e8m0_decode(b):
    # 2^(b - 127) exactly (b = 0 is the subnormal 2^-127); 0xFF is NaN.
    v = tl.where(b == 0, 0x00400000, b << 23)
    return float_of(tl.where(b == 255, 0x7FC00000, v))


@triton.jit
def _store_out(ptr, offs, v, mask, OUT_KIND: tl.constexpr):
    if OUT_KIND == 1:
        # fp32 -> bf16 round to nearest even on the bits (the interpreter's cast truncates); NaN stays a quiet NaN
        # (its payload is not part of the contract: torch's own NaN bits differ by device and vector width).
        u = bits_of(v)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
        r = tl.where(v != v, 0x7FC0 | ((u >> 16) & 0x8000), r)
        tl.store(ptr + offs, r.to(tl.int16), mask=mask)
    else:
        tl.store(ptr + offs, v, mask=mask)


@triton.jit
def _nvfp4_row_global(amax_i):
    """NVFP4 row scale g = amax / (6 * 448) from the blocks' |x| maxima as bits [rows, blocks]; NaN for a row
    holding a non-finite value (Inf / NaN bits order above every finite value)."""
    amax_r = tl.max(amax_i, axis=1)
    return tl.div_rn(tl.where(amax_r < 0x7F800000, float_of(amax_r), float("nan")), 2688.0)


@triton.jit
def _scaled_magnitude(x, sg, ok):
    """(min(RN(|x| / d), 6) or a value that rounds the same, d) for x [rows, blocks, BS] and the per-block scale
    d = s * g (1 where not ``ok``).

    tl.div_rn per element is a branchy ~10-instruction sequence. Instead, per block: scale d by a power of two P
    into [2^-23, 4) (exact), and take r = RN(1 / (d * P)) with one div_rn. Per element: xs = |x| * P (exact
    wherever the quotient matters), then Markstein's iteration: q = xs * r, two fma corrections; with a correctly
    rounded r the last one returns RN(xs / m) = RN(|x| / d) (no ties exist in binary division). This holds
    whenever the quotient is >= 2^-4 (no intermediate underflows); below, only "tiny" matters (index 0), and
    guided rounding also needs "exactly 0", decided by its caller with d. xs is capped at 32 (quotient >= 8,
    saturated either way). Blocks that are not ok (zero, flushed, non-finite scale) divide by 1: their values can
    be anything here, NaN included, since the caller masks their index off."""
    d = tl.where(ok, sg, 1.0)
    p = float_of(tl.minimum(tl.maximum(254 - ((bits_of(d) >> 23) & 0xFF), 1), 253) << 23)
    m = d * p
    r = tl.div_rn(1.0, m)
    m3, r3 = m[:, :, None], r[:, :, None]
    xs = tl.minimum(tl.abs(x) * p[:, :, None], 32.0)
    q = xs * r3
    q = tl.fma(tl.fma(-m3, q, xs), r3, q)
    q = tl.fma(tl.fma(-m3, q, xs), r3, q)
    return tl.minimum(q, 6.0), d


@triton.jit
def _store_codes(q_ptr, code, row64, blks, K, mask, BLOCK_M: tl.constexpr, NBT: tl.constexpr, BS: tl.constexpr):
    # Element 2i in the low nibble, 2i+1 in the high one: pairs are neighbours in a thread's registers.
    lo_c, hi_c = tl.split(tl.reshape(code, [BLOCK_M, NBT, BS // 2, 2]))
    j2 = tl.arange(0, BS // 2)[None, None, :]
    q_offs = (row64 * (K // 2))[:, None, None] + blks[None, :, None] * (BS // 2) + j2
    tl.store(q_ptr + q_offs, (lo_c | (hi_c << 4)).to(tl.uint8), mask=mask)


@triton.jit
def _store_bits(hb_ptr, code, row64, blks, K, mask, BLOCK_M: tl.constexpr, NBT: tl.constexpr, BS: tl.constexpr):
    # Eight mantissa bits per byte, element 8j + b at bit b: a sum over 8 neighbours in a thread.
    m4 = tl.reshape(code & 1, [BLOCK_M, NBT, BS // 8, 8])
    packed_bits = tl.sum(m4 << tl.arange(0, 8)[None, None, None, :], axis=3)
    j8 = tl.arange(0, BS // 8)[None, None, :]
    hb_offs = (row64 * (K // 8))[:, None, None] + blks[None, :, None] * (BS // 8) + j8
    tl.store(hb_ptr + hb_offs, packed_bits.to(tl.uint8), mask=mask)


@triton.jit
def nvfp4_row_codes(x):
    """The arithmetic of ``fp4.quantize(x, "nvfp4", "row")`` for whole rows ``x`` fp32 [rows, blocks, 16] (zeros
    past the row's end): (codes [rows, blocks, 16] int32, sign in bit 3; block-scale bytes [rows, blocks] int32;
    row scales [rows]), the pieces of `_fp4_kernel`. No stores and no new tensors, so a Gluon kernel can call it on
    its own layouts (`gluon_common.quantize_token_block`). Its float arithmetic has no multiply feeding an add
    (explicit FMAs, correctly rounded divisions), so FMA contraction does not change it."""
    xb = bits_of(x)
    amax_i = tl.max(xb & 0x7FFFFFFF, axis=2)
    g = _nvfp4_row_global(amax_i)
    sbyte, _, sg, ok = nvfp4_block_scale(float_of(amax_i), g[:, None])
    a, _ = _scaled_magnitude(x, sg, ok)
    return tl.where(ok[:, :, None], e2m1_nearest(a), 0) | ((xb >> 28) & 8), sbyte, g


@triton.jit
def quantize_rows_nvfp4(x, row64, row_ok, blks, K, q_ptr, sb_ptr, g_ptr, hb_ptr, WRITE_BITS: tl.constexpr,
                        BLOCK_M: tl.constexpr, NBT: tl.constexpr):  # fmt: skip
    """``fp4.quantize(x, "nvfp4", "row")`` of whole rows held by one program, for kernels that fuse it into the
    pass producing them: ``x`` fp32 [BLOCK_M, NBT, 16] (zeros past the row's end) at rows ``row64`` of [M, K].
    Writes what `quantize` writes (codes, scale bytes, row scale, with ``WRITE_BITS`` the hints' mantissa bits),
    through the same pieces as `_fp4_kernel`. Launch with ``enable_fp_fusion=False``."""
    BS: tl.constexpr = 16
    bmask = row_ok[:, None] & (blks < K // BS)[None, :]
    mask = bmask[:, :, None]
    code, sbyte, g = nvfp4_row_codes(x)
    tl.store(g_ptr + row64, g, mask=row_ok)
    _store_codes(q_ptr, code, row64, blks, K, mask, BLOCK_M, NBT, BS)
    tl.store(sb_ptr + (row64 * (K // BS))[:, None] + blks[None, :], sbyte.to(tl.uint8), mask=bmask)
    if WRITE_BITS:
        _store_bits(hb_ptr, code, row64, blks, K, mask, BLOCK_M, NBT, BS)


@triton.jit
def mxfp4_block_scale(amax_b, bad_b):
    """MXFP4 block scale: E8M0 = floor(log2 amax) - 2 from the exponent bits, clamped to [-127, 127], 0xFF for a
    block holding a non-finite value; returns (byte, decoded s: 2^e, or NaN for a bad block, whether s can divide)."""
    ex = ((bits_of(amax_b) >> 23) & 0xFF) - 129
    ex = tl.minimum(tl.maximum(ex, -127), 127)
    ex = tl.where(amax_b == 0, -127, ex)
    sbyte = tl.where(bad_b, 255, ex + 127)
    return sbyte, _e8m0_decode(sbyte), ~bad_b


@triton.jit
def guided_index(x, a, d, hb_ptr, row64, blks, K, mask, BLOCK_M: tl.constexpr, NBT: tl.constexpr, BS: tl.constexpr):
    """E2M1 index of ``x`` [BLOCK_M, NBT, BS] by the recorded mantissa bits (rows ``row64`` of [M, K / 8] bytes at
    ``hb_ptr``), from `_scaled_magnitude`'s (``a``, ``d``)."""
    # A byte per 8 elements, i.e. per thread (a thread holds 8 neighbours).
    j8 = tl.arange(0, BS // 8)[None, None, :]
    hb_offs = (row64 * (K // 8))[:, None, None] + blks[None, :, None] * (BS // 8) + j8
    hbytes = tl.load(hb_ptr + hb_offs, mask=mask, other=0).to(tl.int32)
    bits = (hbytes[:, :, :, None] >> tl.arange(0, 8)[None, None, None, :]) & 1
    # IEEE |x| / d is 0 exactly when |x| <= RD(d * 2^-150): floor(d / 2) subnormal ulps, or d * 2^-150 itself.
    tz = tl.where(d >= 16777216.0, (d * 2.0**-75) * 2.0**-75, float_of((d * 0.5).to(tl.int32)))
    a = tl.where(tl.abs(x) <= tz[:, :, None], 0.0, tl.maximum(a, 1e-30))
    return _e2m1_guided(a, tl.reshape(bits, [BLOCK_M, NBT, BS]))


@triton.jit
def store_values(ptrs, code, s, g, mask, OUT_KIND: tl.constexpr):
    """The dequantized values (E2M1(code) * s) * g of codes [rows, blocks, BS] with per-block ``s`` [rows, blocks]
    and per-row ``g`` [rows, 1], in this order, as the reference (s and g of a hint may be negative). A block's values
    are NaN exactly when 0 * s * g is: that is decided per block, not per element. bf16 (OUT_KIND 1) or fp32."""
    u = bits_of((e2m1_decode(code) * s[:, :, None]) * g[:, :, None])
    zero = (0.0 * s) * g
    nan_b = (zero != zero)[:, :, None]
    if OUT_KIND == 1:
        # fp32 -> bf16 round to nearest even on the bits (the interpreter's cast truncates).
        r = tl.where(nan_b, 0x7FC0, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
        tl.store(ptrs, r.to(tl.int16), mask=mask)
    else:
        tl.store(ptrs, float_of(tl.where(nan_b, 0x7FC00000, u)), mask=mask)


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])  # token counts: see kernels/README.md
def _row_amax_kernel(x_ptr, amax_ptr, M, K, IN_KIND: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """amax |x| of each row, NaN if the row holds a non-finite value (the reference's group policy)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    base = rows.to(tl.int64)[:, None] * K
    amax = tl.zeros([ROWS], dtype=tl.float32)
    bad = tl.zeros([ROWS], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = _load_f32(x_ptr, base + cols[None, :], mask, IN_KIND)
        fin = is_finite(x)
        # Max over finite values only: NaN handling of max differs between backends, the flag decides.
        amax = tl.maximum(amax, tl.max(tl.where(fin, tl.abs(x), 0.0), axis=1))
        bad = tl.maximum(bad, tl.max((~fin).to(tl.int32), axis=1))
    amax = tl.where(bad > 0, float("nan"), amax)
    tl.store(amax_ptr + rows, amax, mask=row_ok)


@triton.jit(do_not_specialize=["M", "rows_per_g", "pad_id"])  # token counts: see kernels/README.md
def _fp4_kernel(
    x_ptr,
    g_ptr,  # NVFP4 global scale per group of rows: written in MODE_ROW, read otherwise
    sb_ptr,  # block-scale bytes [M, K / BS]: written, or read in MODE_GUIDED
    hb_ptr,  # mantissa bits [M, K / 8]: written if WRITE_BITS, read in MODE_GUIDED
    q_ptr,  # packed codes [M, K / 2]
    out_ptr,  # dequantized values [M, K]
    ids_ptr,  # ROW_IDS: an id per row [M]; rows whose id is pad_id or more are skipped
    M,
    K,
    rows_per_g,
    pad_id,
    MODE: tl.constexpr,
    NVFP4: tl.constexpr,
    IN_KIND: tl.constexpr,
    OUT_KIND: tl.constexpr,
    WRITE_Q: tl.constexpr,
    WRITE_BITS: tl.constexpr,
    WRITE_OUT: tl.constexpr,
    ROW_IDS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BS: tl.constexpr,
):
    # A [BLOCK_M, BLOCK_K] tile, seen as [BLOCK_M, NBT, BS]: rows x scale blocks x elements of a block. The loads
    # are 16-byte vectors along BS, so a thread holds whole half-blocks and every per-block reduction stays in
    # registers. Everything per block ([BLOCK_M, NBT]) is computed once per block, never per element. In MODE_ROW
    # a tile spans whole rows (the row amax is the global scale). Offsets in a row are int32, row bases int64.
    NBT: tl.constexpr = BLOCK_K // BS
    NB = K // BS
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    blks = tl.program_id(1) * NBT + tl.arange(0, NBT)
    row64 = rows.to(tl.int64)
    row_ok = rows < M
    if ROW_IDS:
        # The experts' sorted, padded rows: a padding row's output is never read, and most of a decode step's rows
        # are padding (a static bound), so a program of padding rows only returns.
        row_ok &= tl.load(ids_ptr + rows, mask=row_ok, other=pad_id) < pad_id
        if tl.max(row_ok.to(tl.int32), axis=0) == 0:
            return
    bmask = row_ok[:, None] & (blks < NB)[None, :]  # [BLOCK_M, NBT]
    mask = bmask[:, :, None]
    e = tl.arange(0, BS)[None, None, :]
    base = (row64 * K)[:, None, None]
    x = _load_f32(x_ptr + base, blks[None, :, None] * BS + e, mask, IN_KIND)
    xb = bits_of(x)
    # One integer max over |x|'s bits: non-negative floats order as their bits, and Inf / NaN above every finite
    # value, so it gives the block amax and, as a non-finite result, a poisoned block (NaN-proof on both backends).
    amax_i = tl.max(xb & 0x7FFFFFFF, axis=2)  # [BLOCK_M, NBT]
    amax_b = float_of(amax_i)
    bad_b = amax_i >= 0x7F800000

    # ---- per block: s (fp32 decoded block scale), g, and the byte written for s --------------------------------
    if MODE == 2:
        sbyte = tl.load(sb_ptr + (row64 * NB)[:, None] + blks[None, :], mask=bmask, other=0).to(tl.int32) & 0xFF
        g = tl.load(g_ptr + rows // rows_per_g, mask=rows < M, other=1.0)[:, None]
        # A non-finite training value poisons its block: NaN scale byte, so it dequantizes to NaN.
        if NVFP4:
            s = e4m3_decode(tl.where(bad_b, 0x7F, sbyte))
        else:
            s = _e8m0_decode(tl.where(bad_b, 0xFF, sbyte))
        sg = s * g
        ok = is_finite(sg) & (sg > 0)
    elif NVFP4:
        if MODE == 0:
            g = _nvfp4_row_global(amax_i)
            if WRITE_Q:
                tl.store(g_ptr + rows, g, mask=row_ok)
            g = g[:, None]
        else:
            g = tl.load(g_ptr + rows // rows_per_g, mask=rows < M, other=1.0)[:, None]
        sbyte, s, sg, ok = nvfp4_block_scale(amax_b, g)
    else:
        sbyte, s, ok = mxfp4_block_scale(amax_b, bad_b)
        g = tl.full([BLOCK_M, 1], 1.0, tl.float32)
        sg = s

    a, d = _scaled_magnitude(x, sg, ok)
    if MODE == 2:
        idx = guided_index(x, a, d, hb_ptr, row64, blks, K, mask, BLOCK_M, NBT, BS)
    else:
        idx = e2m1_nearest(a)
    idx = tl.where(ok[:, :, None], idx, 0)
    code = idx | ((xb >> 28) & 8)  # sign bit: -0, and anything rounding to zero, keep it

    # ---- outputs ----------------------------------------------------------------------------------------
    if WRITE_Q:
        _store_codes(q_ptr, code, row64, blks, K, mask, BLOCK_M, NBT, BS)
        if MODE != 2:
            tl.store(sb_ptr + (row64 * NB)[:, None] + blks[None, :], sbyte.to(tl.uint8), mask=bmask)
    if WRITE_BITS:
        _store_bits(hb_ptr, code, row64, blks, K, mask, BLOCK_M, NBT, BS)
    if WRITE_OUT:
        store_values(out_ptr + base + blks[None, :, None] * BS + e, code, s, g, mask, OUT_KIND)


@triton.jit(do_not_specialize=["M", "rows_per_g"])  # token counts: see kernels/README.md
def _dequant_kernel(
    q_ptr,
    sb_ptr,
    g_ptr,
    out_ptr,
    M,
    K,
    rows_per_g,
    NVFP4: tl.constexpr,
    OUT_KIND: tl.constexpr,
    ROWS: tl.constexpr,
    NBT: tl.constexpr,
    BS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    blks = tl.program_id(1) * NBT + tl.arange(0, NBT)
    NB = K // BS
    r3 = rows.to(tl.int64)[:, None, None]
    b3 = blks[None, :, None]
    bmask = (rows < M)[:, None, None] & (b3 < NB)
    j2 = tl.arange(0, BS // 2)[None, None, :]
    p = tl.load(q_ptr + r3 * (K // 2) + b3 * (BS // 2) + j2, mask=bmask, other=0).to(tl.int32) & 0xFF
    # Low nibble is element 2i, high nibble 2i+1: join on a new last axis, then flatten it back in.
    code = tl.reshape(tl.join(p & 15, p >> 4), [ROWS, NBT, BS])
    sbyte = tl.load(sb_ptr + r3 * NB + b3, mask=bmask, other=0).to(tl.int32) & 0xFF
    if NVFP4:
        s = e4m3_decode(sbyte)
    else:
        s = _e8m0_decode(sbyte)
    g = tl.load(g_ptr + r3 // rows_per_g, mask=bmask, other=1.0)
    val = (e2m1_decode(code) * s) * g
    e3 = tl.arange(0, BS)[None, None, :]
    _store_out(out_ptr, r3 * K + b3 * BS + e3, val, bmask & (e3 < BS), OUT_KIND)


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------

#: Launch parameters per kernel path, pinned from `benchmarks/kernels/fp4_quant.py --sweep` on an H200 (bf16 [65536, 2048]):
#: ``tile`` elements per program (BLOCK_M * BLOCK_K), ``block_k`` columns per program (a row-scale quantize spans
#: whole rows whatever it says), ``num_warps``. These kernels stream: a program only needs enough independent
#: 16-byte loads in flight, with each thread holding whole half-blocks of 8 bf16. Under the interpreter programs
#: run one after another in numpy, so there a program is ``tile_interpreted`` elements. ``max_row`` is the widest
#: row the row-scale kernel keeps in registers (wider rows take a separate amax pass).
# Launch parameters per path: the best of `benchmarks/kernels/fp4_quant.py --sweep` on an H200 ([65536, 2048] bf16;
# docs/lab-notes.md has the run).
CONFIG = {
    "quantize": {"tile": 2048, "block_k": 2048, "num_warps": 2},  # quantize / guided_quantize (+ hints)
    "fake": {"tile": 2048, "block_k": 2048, "num_warps": 2},  # fake_quantize, nearest
    "guided_fake": {"tile": 2048, "block_k": 2048, "num_warps": 8},  # fake_quantize with hints
    "dequantize": {"tile": 4096, "block_k": 1024, "num_warps": 4},
    "tile_interpreted": 1 << 17,
    "max_row": 16384,
    # A call of at most this many values (a decode step's few hundred rows) is one dependent chain per thread, not a
    # stream of bytes: it gets warps for at most ``small_values_per_thread`` values per thread (16 instead of 32: the
    # hidden activation's quantization at batch 20 and 64, +0.8% and +0.3% decode, docs/lab-notes.md 2h; 8 and 4 less).
    # 2^23 takes in the hidden's quantization at batch 256 and 512 (~3-6M values): +0.4% decode at both, two rounds
    # each, where 8 values per thread gained nothing (docs/lab-notes.md 10).
    "small_call": 1 << 23,
    "small_values_per_thread": 16,
}


def _as_input(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Contiguous [M, K] view of ``x`` the kernels can load, and its kind."""
    x = x.reshape(-1, x.shape[-1]).contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16), _BF16
    if x.dtype == torch.float16:
        return x, _F16
    # fp32 as is; any other float dtype rounds to fp32 first, as the reference's x.float().
    return x.float(), _F32


def _out_kind(dtype: torch.dtype) -> int:
    """What the kernel writes for ``dtype``: fp32 and bf16 directly, other dtypes fp32 then torch's cast."""
    return _BF16 if dtype == torch.bfloat16 else _F32


def _tiles(M: int, K: int, bs: int, whole_row: bool, path: str) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_K, grid dim 1, num_warps) for [M, K] in blocks of ``bs`` with the ``CONFIG[path]`` launch."""
    cfg = CONFIG[path]
    k_pad = triton.next_power_of_2(K)
    block_k = k_pad if whole_row else max(bs, min(k_pad, triton.next_power_of_2(cfg["block_k"])))
    tile = CONFIG["tile_interpreted"] if INTERPRETED else cfg["tile"]
    block_m = 1 << (max(1, tile // block_k).bit_length() - 1)  # a power of two at most tile / block_k
    block_m = min(block_m, triton.next_power_of_2(max(M, 1)))
    # No more warps than 16-byte vectors in the tile: idle (replicated) threads would only add instructions.
    num_warps = max(1, min(cfg["num_warps"], block_m * block_k // 256))
    values = M * K
    if values <= CONFIG["small_call"]:
        num_warps = max(num_warps, min(32, block_m * block_k // (32 * CONFIG["small_values_per_thread"])))
    return block_m, block_k, triton.cdiv(K, block_k), num_warps


def _row_amax(x2: torch.Tensor, kind: int) -> torch.Tensor:
    M, K = x2.shape
    amax = torch.empty(M, dtype=torch.float32, device=x2.device)
    block_k = min(triton.next_power_of_2(K), 4096)
    rows = max(1, min(triton.next_power_of_2(M), (CONFIG["tile_interpreted"] if INTERPRETED else 4096) // block_k))
    _row_amax_kernel[(triton.cdiv(M, rows),)](x2, amax, M, K, kind, rows, block_k, num_warps=4, enable_fp_fusion=False)
    return amax


def _global_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / (6 * 448) with the reference's NaN; an IEEE division on every device (a tensor divisor: torch on
    CUDA turns a division by a Python scalar into a multiplication by its rounded reciprocal)."""
    amax = torch.where(torch.isnan(amax), torch.full_like(amax, float("nan")), amax)
    return amax / torch.full_like(amax, 6.0 * 448.0)


def _launch_fp4(x2, kind, g, sb, hb, q, out, rows_per_g, *, path, mode, nvfp4, out_kind=0, write_q, write_bits,
                row_ids=None, pad_id=0):  # fmt: skip
    M, K = x2.shape
    bs = 16 if nvfp4 else 32
    block_m, block_k, n_col, warps = _tiles(M, K, bs, mode == _MODE_ROW and nvfp4, path)
    dummy = x2  # never touched: its constexpr switch is off
    _fp4_kernel[(triton.cdiv(M, block_m), n_col)](
        x2,
        g if g is not None else dummy,
        sb if sb is not None else dummy,
        hb if hb is not None else dummy,
        q if q is not None else dummy,
        out if out is not None else dummy,
        row_ids if row_ids is not None else dummy,
        M,
        K,
        rows_per_g,
        pad_id,
        MODE=mode,
        NVFP4=nvfp4,
        IN_KIND=kind,
        OUT_KIND=out_kind,
        WRITE_Q=write_q,
        WRITE_BITS=write_bits,
        WRITE_OUT=out is not None,
        ROW_IDS=row_ids is not None,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        BS=bs,
        num_warps=warps,
        enable_fp_fusion=False,
    )


def _nvfp4_global(x: torch.Tensor, x2: torch.Tensor, kind: int, scale: str) -> tuple[int, torch.Tensor, int]:
    """(mode, global scale shaped as the reference's, rows per global scale) for an NVFP4 launch."""
    M, K = x2.shape
    if scale == "row":
        g = torch.empty(x.shape[:-1] + (1,), dtype=torch.float32, device=x.device)
        if INTERPRETED or triton.next_power_of_2(K) <= CONFIG["max_row"]:
            return _MODE_ROW, g, 1  # the kernel takes the row amax in the same pass
        g.copy_(_global_scale(_row_amax(x2, kind)).view(g.shape))
        return _MODE_GIVEN_G, g, 1
    if scale == "tensor":
        g = _global_scale(_row_amax(x2, kind).amax()).reshape([1] * x.ndim)
        return _MODE_GIVEN_G, g, M
    if scale == "expert":
        if x.ndim < 2:
            raise ValueError("scale='expert' needs a tensor with a leading expert dimension, e.g. [E, N, K].")
        E = x.shape[0]
        g = _global_scale(_row_amax(x2, kind).view(E, -1).amax(dim=1)).reshape([E] + [1] * (x.ndim - 1))
        return _MODE_GIVEN_G, g, M // E
    raise ValueError(f"Unknown scale mode {scale!r}: use 'row', 'tensor' or 'expert'.")


def _hint_tensors(x: torch.Tensor, hints: FP4Hints) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hints as the kernel reads them: scale bytes [M, K / bs], bits [M, K / 8], one global scale per row."""
    lead, K = x.shape[:-1], x.shape[-1]
    sb = hints.block_scale.reshape(-1, hints.block_scale.shape[-1]).contiguous()
    hb = hints.mantissa_bits.reshape(-1, K // 8).contiguous()
    g = hints.global_scale.to(torch.float32).expand(lead + (1,)).reshape(-1).contiguous()
    return sb, hb, g


def quantize(
    x: torch.Tensor,
    fmt: str = "nvfp4",
    scale: str = "row",
    return_hints: bool = False,
    row_ids: torch.Tensor | None = None,
    pad_id: int = 0,
):
    """`trace_hf.fp4.quantize` in one pass (plus a global amax pass for ``scale`` "tensor" / "expert").

    With ``return_hints`` also returns the `FP4Hints` of the result (mantissa bits written in the same pass).
    ``row_ids`` (int32, one per row of a 2-D ``x``, ``scale`` "row"): rows whose id is ``pad_id`` or more are
    skipped, their codes, scales and hints left as allocated (uninitialized); every other row is what it would be
    without. For `moe_align`'s sorted, padded rows, whose padding nothing reads.
    """
    f = check_input(x, fmt)
    check_scale(x, scale)
    check_device(x)
    if row_ids is not None and (x.ndim != 2 or scale != "row" or row_ids.shape != x.shape[:1]
                                or row_ids.dtype != torch.int32 or row_ids.device != x.device):  # fmt: skip
        raise ValueError(
            f"row_ids must be an int32 tensor of one id per row of a 2-D input on its device, with scale='row'; got "
            f"row_ids {tuple(row_ids.shape)} {row_ids.dtype} on {row_ids.device} for x {tuple(x.shape)} on "
            f"{x.device}, scale={scale!r}."
        )
    if x.numel() == 0:
        q = fp4.quantize(x, f.name, scale, backend="torch")
        return (q, fp4.extract_hints(q)) if return_hints else q
    lead, K = x.shape[:-1], x.shape[-1]
    x2, kind = _as_input(x)
    packed = torch.empty(lead + (K // 2,), dtype=torch.uint8, device=x.device)
    sb = torch.empty(lead + (K // f.block_size,), dtype=torch.uint8, device=x.device)
    hb = torch.empty(lead + (K // 8,), dtype=torch.uint8, device=x.device) if return_hints else None
    if f.has_global_scale:
        mode, g, rows_per_g = _nvfp4_global(x, x2, kind, scale)
    else:
        mode, g, rows_per_g = _MODE_ROW, torch.ones(lead + (1,), dtype=torch.float32, device=x.device), 1
    _launch_fp4(
        x2, kind, g, sb, hb, packed, None, rows_per_g, path="quantize",
        mode=mode, nvfp4=f.has_global_scale, write_q=True, write_bits=return_hints, row_ids=row_ids, pad_id=pad_id,
    )  # fmt: skip
    q = FP4Tensor(packed, sb, g, f.name)
    return (q, FP4Hints(hb, sb, g, f.name)) if return_hints else q


def guided_quantize(x: torch.Tensor, hints: FP4Hints) -> FP4Tensor:
    """`trace_hf.fp4.guided_quantize`: the rollout's scales, and of two neighbours the recorded mantissa bit."""
    f = check_hints(x, hints)
    check_device(x)
    if x.numel() == 0:
        return fp4.guided_quantize(x, hints, backend="torch")
    x2, kind = _as_input(x)
    sb, hb, g = _hint_tensors(x, hints)
    packed = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=torch.uint8, device=x.device)
    _launch_fp4(
        x2, kind, g, sb, hb, packed, None, 1, path="quantize",
        mode=_MODE_GUIDED, nvfp4=f.has_global_scale, write_q=True, write_bits=False,
    )  # fmt: skip
    # Blocks with a non-finite value carry the NaN scale byte (the kernel already zeroed their codes).
    bad = ~torch.isfinite(x).unflatten(-1, (-1, f.block_size)).all(dim=-1)
    block_scale = torch.where(bad, 0x7F if f.has_global_scale else 0xFF, hints.block_scale)
    return FP4Tensor(packed, block_scale.to(torch.uint8), hints.global_scale, f.name)


def fake_quantize(x: torch.Tensor, fmt: str | None = None, scale: str = "row", hints: FP4Hints | None = None):
    """Quantize and dequantize in one pass, in ``x.dtype``: ``fp4.quantize(x, fmt, scale).dequantize(x.dtype)``,
    or with ``hints`` ``fp4.guided_quantize(x, hints).dequantize(x.dtype)``, bit for bit. No autograd here:
    `trace_hf.fp4.fake_quantize` wraps it in the straight-through estimator."""
    fmt = fp4.fake_format(fmt, hints)
    if hints is not None:
        f = check_hints(x, hints)
    else:
        f = check_input(x, fmt)
        check_scale(x, scale)
    check_device(x)
    if x.numel() == 0:
        return fp4.fake_quantize(x, f.name, scale, hints, backend="torch")
    x2, kind = _as_input(x)
    out_kind = _out_kind(x.dtype)
    if out_kind == _BF16:
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
        out_arg = out.view(torch.int16)
    else:
        out = out_arg = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if hints is not None:
        sb, hb, g = _hint_tensors(x, hints)
        mode, rows_per_g = _MODE_GUIDED, 1
    else:
        sb = hb = None
        if f.has_global_scale:
            mode, g, rows_per_g = _nvfp4_global(x, x2, kind, scale)
            if mode == _MODE_ROW:
                g = None  # the kernel computes it in registers and does not write it
        else:
            mode, g, rows_per_g = _MODE_ROW, None, 1
    _launch_fp4(
        x2, kind, g, sb, hb, None, out_arg, rows_per_g, path="fake" if hints is None else "guided_fake",
        mode=mode, nvfp4=f.has_global_scale, out_kind=out_kind, write_q=False, write_bits=False,
    )  # fmt: skip
    return out if out.dtype == x.dtype else out.to(x.dtype)


def dequantize(q: FP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`FP4Tensor.dequantize`: ``(E2M1(code) * s) * g`` in fp32, then ``dtype``."""
    f = q.check_layout()
    check_device(q.packed)
    shape = q.shape
    if q.packed.numel() == 0:
        return q.dequantize(dtype)
    K = shape[-1]
    M = q.packed.numel() // (K // 2)
    packed = q.packed.reshape(M, K // 2).contiguous()
    sb = q.block_scale.reshape(M, K // f.block_size).contiguous()
    g = q.global_scale.to(torch.float32).expand(shape[:-1] + (1,)).reshape(-1).contiguous()
    out_kind = _out_kind(dtype)
    out = torch.empty(shape, dtype=torch.bfloat16 if out_kind == _BF16 else torch.float32, device=q.packed.device)
    block_m, block_k, n_col, warps = _tiles(M, K, f.block_size, False, "dequantize")
    _dequant_kernel[(triton.cdiv(M, block_m), n_col)](
        packed, sb, g, out.view(torch.int16) if out_kind == _BF16 else out, M, K, 1,
        NVFP4=f.has_global_scale, OUT_KIND=out_kind, ROWS=block_m, NBT=block_k // f.block_size, BS=f.block_size,
        num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return out if out.dtype == dtype else out.to(dtype)
