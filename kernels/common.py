# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""What every kernel of trace_hf.kernels shares: the interpreter switch, the device check, the FP4 formats' scalar
pieces as bit logic (`trace_hf.fp4` is their specification; docs/numerics.md), and the FP4 operand loaders of the
GEMM-shaped kernels (experts and attention).

One definition each, imported by name: `fp4_quant` (quantization), `fp4_moe` and its backends (experts),
`fp4_attention` (KV cache and decode attention) and `decode_ops` (fused decode ops) build on these and export nothing
to each other. What only some of them share has a module of its own: `gluon_common` (the Gluon kernels: it imports
Gluon, which this module must not) and `fp4_moe_common` (the experts' backends).
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.common (see kernels/README.md), not kernels.common.")

import functools  # noqa: E402
import importlib  # noqa: E402
import os  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


#: Kernels run on CPU tensors through Triton's interpreter (tests and CI); read once, as triton itself does.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------


def check_device(x: torch.Tensor) -> None:
    """Every kernel of trace_hf.kernels takes CUDA tensors, or CPU ones under the interpreter."""
    if x.is_cuda or INTERPRETED:
        return
    raise RuntimeError(
        f"trace_hf.kernels runs Triton kernels and got a tensor on {x.device}: pass a CUDA tensor, or set "
        "TRITON_INTERPRET=1 before triton is first imported to run the kernels on CPU (slow, for tests)."
    )


@functools.cache
def gluon_module(name: str):
    """The Gluon kernel module ``trace_hf.kernels.<name>``, or None, with one warning, where this Triton lacks the
    Gluon pieces it uses (measured with Triton 3.6; older ones fall back to the Triton kernels)."""
    try:
        return importlib.import_module(f"trace_hf.kernels.{name}")
    except (ImportError, AttributeError) as e:
        warnings.warn(f"Triton {triton.__version__} lacks Gluon's MMA layouts ({e}); the Triton kernels run instead of "
                      f"{name}. Triton >= 3.6 gives the faster Hopper kernels.", stacklevel=3)  # fmt: skip
        return None


def hardware_fp8(device: torch.device) -> bool:
    """Whether the GPU converts E4M3 in hardware (sm_89 and up: Ada, Hopper, Blackwell), which the halves and PTX
    decodings use; older GPUs (A100) run the interleaved tiles with integer decoding. True in the interpreter,
    which emulates the conversion."""
    return INTERPRETED or device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


# ----------------------------------------------------------------------------------------------------------
# Scalar formats, as bit logic
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def bits_of(v):
    return v.to(tl.int32, bitcast=True)


@triton.jit
def float_of(b):
    return b.to(tl.float32, bitcast=True)


@triton.jit
def round_bf16(x, BF16: tl.constexpr):
    """fp32 -> the nearest bf16 value (ties to even, NaN kept), still fp32: how torch rounds a bf16 op's fp32 result
    (the interpreter's ``.to(bfloat16)`` truncates). Identity where ``BF16`` is off (fp32 tensors do not round)."""
    if BF16:
        b = x.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        x = tl.where(x != x, x, b.to(tl.float32, bitcast=True))
    return x


#: The dtypes whose rounding the kernels that follow torch's elementwise ops (`rms_norm`, `rope`) reproduce.
ROUNDED_DTYPES = (torch.bfloat16, torch.float32)


@triton.jit
def is_finite(v):
    # Exponent all ones means Inf or NaN; comparisons against Inf would need NaN care on two backends.
    return (bits_of(v) & 0x7F800000) != 0x7F800000


@triton.jit
def e2m1_nearest(a):
    """Round-to-nearest-even index 0..7 of 0 <= a <= 6 on 0, .5, 1, 1.5, 2, 3, 4, 6, from the fp32 bits.

    Below 1 the grid steps by 0.5: adding 2^22 (whose ulp is 0.5) rounds 2a to an integer, ties to even, in the
    low bits. From 1 up the grid keeps one mantissa bit: round the bits at bit 22 (ties to even, a carry bumps the
    exponent), then ``exponent * 2 + mantissa bit`` is the index (1.0 is 127 << 1, index 2). ~9 instructions where
    a chain of 7 comparisons takes 14."""
    u = bits_of(a)
    small = bits_of(a + 4194304.0) - 0x4A800000
    big = ((u + 0x1FFFFF + ((u >> 22) & 1)) >> 22) - 252
    return tl.where(a < 1.0, small, big)


@triton.jit
def e2m1_decode(code):
    # Index 2..7 is 2^((i >> 1) - 1) * (1 + (i & 1) / 2): build the fp32 bits; 0 and 0.5 by hand; sign in bit 3.
    i = code & 7
    mag = (((i >> 1) + 126) << 23) | ((i & 1) << 22)
    mag = tl.where(i >= 2, mag, tl.where(i == 1, 0x3F000000, 0))
    return float_of(mag | ((code & 8) << 28))


@triton.jit
def e4m3_encode(v):
    """RNE E4M3 byte of 0 <= v <= 448 (not NaN)."""
    u = bits_of(v) & 0x7FFFFFFF
    # Normal: add half an E4M3 ulp minus one, plus the kept lsb (ties to even); a mantissa carry bumps the
    # exponent by itself. Rebias 127 -> 7.
    normal = ((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal (v < 2^-6): code = v / 2^-9 rounded to an even integer; v * 512 is exact, so is its fraction.
    t = v * 512.0
    ti = t.to(tl.int32)
    frac = t - ti.to(tl.float32)
    sub = ti + ((frac > 0.5) | ((frac == 0.5) & ((ti & 1) == 1))).to(tl.int32)
    return tl.where(u < 0x3C800000, sub, normal)


@triton.jit
def e4m3_decode(b):
    # fp32 of an E4M3 byte (exact); 0x7F / 0xFF are NaN.
    e = (b >> 3) & 15
    m = b & 7
    sub = bits_of(m.to(tl.float32) * 0.001953125)  # m * 2^-9, exact
    mag = tl.where(e == 0, sub, ((e + 120) << 23) | (m << 20))
    mag = tl.where((b & 0x7F) == 0x7F, 0x7FF00000, mag)
    return float_of(mag | ((b & 0x80) << 24))


@triton.jit
def nvfp4_block_scale(amax_b, g):
    """NVFP4 block scale of the spec: byte = E4M3((amax_b / 6) / g), 0 for an all-zero group (g == 0), NaN byte
    0x7F for a poisoned one; returns (byte, decoded s, the fp32 product s * g, whether s * g can divide)."""
    v = tl.div_rn(tl.div_rn(amax_b, 6.0), g)
    sbyte = e4m3_encode(tl.where(v != v, 0.0, tl.minimum(v, 448.0)))
    sbyte = tl.where(v != v, 0x7F, sbyte)
    sbyte = tl.where(g == 0, 0, sbyte)
    sbyte = tl.where(g != g, 0x7F, sbyte)
    s = e4m3_decode(sbyte)
    sg = s * g
    return sbyte, s, sg, is_finite(sg) & (sg > 0)


# ----------------------------------------------------------------------------------------------------------
# FP4 GEMM operands (the experts and the attention)
# ----------------------------------------------------------------------------------------------------------


#: bf16 dot operands on the GPU; fp32 in the interpreter (its bf16 arithmetic is wrong).
DOT_BF16 = not INTERPRETED


@triton.jit
def load_fp4_rows(q_ptr, s_ptr, rows, row_mask, k0, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``E2M1(code) * s`` (fp32, exact) of columns ``k0 .. k0 + BLOCK_K`` of rows ``rows`` of a packed NVFP4
    matrix with ``K`` columns (codes [*, K / 2], E4M3 scale bytes [*, K / 16]); masked rows read as 0."""
    r = rows.to(tl.int64)[:, None]
    kk = k0 // 2 + tl.arange(0, BLOCK_K // 2)[None, :]
    p = tl.load(q_ptr + r * (K // 2) + kk, mask=row_mask[:, None], other=0).to(tl.int32) & 0xFF
    # Element 2i sits in the low nibble, 2i + 1 in the high one: join on a new last axis and flatten it in.
    code = tl.reshape(tl.join(p & 15, p >> 4), [ROWS, BLOCK_K])
    ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)[None, :]
    sb = tl.load(s_ptr + r * (K // 16) + ks, mask=row_mask[:, None], other=0).to(tl.int32) & 0xFF
    s = tl.reshape(tl.broadcast_to(e4m3_decode(sb)[:, :, None], [ROWS, BLOCK_K // 16, 16]), [ROWS, BLOCK_K])
    return e2m1_decode(code) * s


@triton.jit
def e2m1_times_2_pow_m14(code):
    """E2M1 codes (int32, 0..15) as fp16 bit patterns: magnitude bits under the fp16 exponent's low bits, so the
    value is ``E2M1 * 2^-14`` exactly (code 1 lands on an fp16 subnormal, which conversions keep). Five integer
    operations and one conversion instead of `e2m1_decode`'s dozen; the 2^14 goes into the block scale."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e4m3_hw(b):
    """fp32 value of E4M3 bytes (uint8) by the hardware fp8 conversion; 0x7F / 0xFF are NaN (the interpreter
    would give 480)."""
    v = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), v)


def _f16_halves_ptx() -> str:
    """The PTX text, one block per pair of code bytes (bytes 0-1: prmt selector 0x1404, outputs $0 and $2, scales
    s01; bytes 2-3: 0x3424, $1 and $3, s23)."""
    pair = (
        "prmt.b32 t, $4, 0, {sel};\n"
        "shl.b32 u, t, 1;\nand.b32 u, u, 0x0E000E00;\nshl.b32 v, t, 4;\nand.b32 v, v, 0x80008000;\n"
        "or.b32 u, u, v;\nmul.rn.f16x2 {lo}, u, {s};\n"
        "shr.b32 u, t, 3;\nand.b32 u, u, 0x0E000E00;\nand.b32 v, t, 0x80008000;\n"
        "or.b32 u, u, v;\nmul.rn.f16x2 {hi}, u, {s};\n"
    )
    return (
        "{\n.reg .b32 t, u, v, s01, s23;\n.reg .b16 sl, sh;\nmov.b32 {sl, sh}, $5;\n"
        "cvt.rn.f16x2.e4m3x2 s01, sl;\ncvt.rn.f16x2.e4m3x2 s23, sh;\n"
        + pair.format(sel="0x1404", lo="$0", hi="$2", s="s01")
        + pair.format(sel="0x3424", lo="$1", hi="$3", s="s23")
        + "}\n"
    )


#: Inline PTX for `fp4_halves_f16`: 4 code bytes ($4) and their 4 E4M3 scale bytes ($5) to the fp16 pairs
#: ``E2M1 * s * 2^-14`` of the low nibbles ($0: bytes 0-1, $1: bytes 2-3) and the high nibbles ($2, $3). prmt puts
#: byte j in the high byte of a 16-bit lane; a nibble's sign then needs one shift to bit 15 and its 3 magnitude bits
#: one shift to bits 9-11, under the fp16 exponent's low bits (value ``E2M1 * 2^-14``, code 1 an fp16 subnormal,
#: which f16 arithmetic without .ftz keeps); one f16x2 multiply by the scale, converted by the hardware (0x7F is
#: NaN), is exact: the product has at most 6 significant bits, all at or above 2^-24, fp16's smallest subnormal.
#: About 2.5 instructions per element against the dozen of the fp32 decoding.
_F16_HALVES_PTX = tl.constexpr(_f16_halves_ptx())


@triton.jit
def fp4_halves_f16(p, sb):
    """Packed code bytes and their (repeated) E4M3 scale bytes, both uint8, to the fp16 tiles
    ``(E2M1(low nibble) * s * 2^-14, E2M1(high nibble) * s * 2^-14)``, exactly (GPU only: inline PTX)."""
    return tl.inline_asm_elementwise(
        _F16_HALVES_PTX, "=r,=r,=r,=r,r,r", [p, sb], dtype=(tl.float16, tl.float16), is_pure=True, pack=4
    )


@triton.jit
def load_halves(
    ptr, q_s_ptr, rows, row_mask, k0, K, FP4: tl.constexpr, BLOCK_K: tl.constexpr, PTX: tl.constexpr = False
):
    """Even and odd columns of ``k0 .. k0 + BLOCK_K`` as two [rows, BLOCK_K / 2] fp32 tiles. A dot product may
    sum its terms in any order, so ``a_even @ w_even + a_odd @ w_odd`` is the whole product; for packed FP4 the
    halves are just the low and high nibbles (no interleaving shuffle), each element's block scale is read
    directly at ``column // 8`` (repeated addresses, served by the cache), and the decoding is the cheap one of
    `e2m1_times_2_pow_m14` and `e4m3_hw` (exact, like `load_fp4_rows`). With ``PTX`` the tiles are fp16 and
    carry a factor 2^-14 (`fp4_halves_f16`), which the caller takes out of the accumulator."""
    r = rows.to(tl.int64)[:, None]
    j = tl.arange(0, BLOCK_K // 2)[None, :]
    m = row_mask[:, None]
    if FP4 and PTX:
        # [rows, blocks, 8 bytes]: one scale byte per 16-element block, broadcast in registers.
        blk = tl.arange(0, BLOCK_K // 16)[None, :, None]
        r3, m3 = r[:, :, None], m[:, :, None]
        p = tl.load(ptr + r3 * (K // 2) + (k0 // 2 + blk * 8 + tl.arange(0, 8)[None, None, :]), mask=m3, other=0)
        sb = tl.load(q_s_ptr + r3 * (K // 16) + (k0 // 16 + blk), mask=m3, other=0)
        lo, hi = fp4_halves_f16(p.to(tl.uint8, bitcast=True), tl.broadcast_to(sb.to(tl.uint8, bitcast=True), p.shape))
        return tl.reshape(lo, [lo.shape[0], BLOCK_K // 2]), tl.reshape(hi, [hi.shape[0], BLOCK_K // 2])
    elif FP4:
        p = tl.load(ptr + r * (K // 2) + (k0 // 2 + j), mask=m, other=0).to(tl.int32) & 0xFF
        sb = tl.load(q_s_ptr + r * (K // 16) + (k0 // 16 + j // 8), mask=m, other=0)
        s = e4m3_hw(sb.to(tl.uint8, bitcast=True)) * 16384.0
        return e2m1_times_2_pow_m14(p & 15) * s, e2m1_times_2_pow_m14(p >> 4) * s
    else:
        base = ptr + r * K + k0 + 2 * j
        return tl.load(base, mask=m, other=0.0).to(tl.float32), tl.load(base + 1, mask=m, other=0.0).to(tl.float32)
