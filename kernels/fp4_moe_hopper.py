# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""W4A4 routed-expert GEMMs for decode on Hopper, in Gluon: packed codes go from global memory straight into the
tensor-core operand registers, with no layout shuffle.

Why: the Triton kernels of `fp4_moe` decode FP4 into a blocked layout and let the compiler move the values into the
MMA operand layout; on sm_90 that shuffle plus its address arithmetic costs about 7 instructions per weight element
and leaves the decode step instruction-bound at ~20% of copy bandwidth. Here the layouts are explicit:

* **Weights are the MMA's A operand** (``out^T = W @ x^T``, "swap AB"): the many weight rows fill the 16-row MMA
  tile and the few tokens of an expert fill its 8-wide N side, so a decode batch does not pad tokens to 16.
* **Each 16-bit word of packed codes is four K-slices.** A thread of ``mma.m16n8k16`` holds pairs of consecutive K
  per register (``k_width=2``). Reading the packed codes as ``uint16`` in exactly that operand layout, register
  ``r`` holds words ``k', k'+1``; nibble ``j`` of both (16 bits apart) decodes with one pair of shifts into an fp16
  pair, which *is* the operand register for K-slice ``j``. The MMA then sums ``sum_j sum_k' W[n, 4k'+j] x[4k'+j]``,
  the whole dot product in another order; activations are decoded the same way, so their K order matches. The
  canonical `FP4Tensor` layout serves as is: no re-layout, nothing for export to convert.
* **Scales ride along.** Words ``k', k'+1`` (elements ``4k' .. 4k'+7``, ``k'`` even) lie in one NVFP4 block, so the
  two scale bytes of the register are equal and one ``cvt.rn.f16x2.e4m3x2`` gives the multiplier pair.

Values are exact as in `fp4_moe` (``E2M1 * s * 2^-14`` has at most 6 significant bits and is >= 2^-24, fp16's
smallest subnormal; products of two are exact in fp32); only the summation order differs from torch's. About 3.9
instructions per weight element instead of 7 (sm_90 SASS, docs/benchmarks.md). GPU only (inline PTX; Gluon does not
run in the interpreter); `fp4_moe.experts_from_quantized` picks these kernels on sm_90+ for W4A4.
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.fp4_moe_hopper (see kernels/README.md), not kernels.fp4_moe_hopper.")

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: E402


def scale_pair_ptx(lo: str, hi: str) -> list[str]:
    """PTX lines: the E4M3 bytes in registers ``lo`` and ``hi`` to the fp16 pair ``sc`` = (lo, hi), in hardware
    (0x7F stays NaN). Needs ``.reg .b32 sc; .reg .b16 sl, sh;``."""
    return [f"prmt.b32 sc, {lo}, {hi}, 0x40;", "mov.b32 {sl, sh}, sc;", "cvt.rn.f16x2.e4m3x2 sc, sl;"]


def nibbles_ptx(src: str, outs: list[str]) -> list[str]:
    """PTX lines: nibble j of both 16-bit halves of register ``src`` to the fp16 pair ``outs[j]``, times the fp16
    pair ``sc``. The magnitude bits of a nibble go under the fp16 exponent's low bits (bits 9-11: value
    E2M1 * 2^-14, code 1 an fp16 subnormal), its sign to bit 15; both halves move with the same shift because they
    are 16 bits apart. Needs ``.reg .b32 m, s;``."""
    lines = []
    for j, out in enumerate(outs):
        mag, sign = 9 - 4 * j, 12 - 4 * j
        lines.append(f"shl.b32 m, {src}, {mag};" if mag > 0 else f"shr.b32 m, {src}, {-mag};")
        lines.append(f"shl.b32 s, {src}, {sign};" if sign > 0 else f"mov.b32 s, {src};")
        lines += ["and.b32 m, m, 0x0E000E00;", "and.b32 s, s, 0x80008000;", "or.b32 m, m, s;"]
        lines.append(f"mul.rn.f16x2 {out}, m, sc;")
    return lines


def _decode_ptx() -> str:
    """PTX: a register of two uint16 code words ($4) and their two (equal) E4M3 scale bytes ($5, $6) to four fp16
    pairs ($0..$3), pair j = (nibble j of the low word, nibble j of the high word) * s * 2^-14."""
    head = ["{", ".reg .b32 m, s, sc;", ".reg .b16 sl, sh;"]
    return "\n".join(head + scale_pair_ptx("$5", "$6") + nibbles_ptx("$4", ["$0", "$1", "$2", "$3"]) + ["}"])


_DECODE_PTX = gl.constexpr(_decode_ptx())


@gluon.jit
def _decode(words, scales):
    """uint16 code words and their uint8 block-scale bytes (same layout) to the four fp16 K-slices
    ``E2M1 * s * 2^-14``."""
    return gl.inline_asm_elementwise(
        _DECODE_PTX, "=r,=r,=r,=r,r,r,r", [words, scales.to(gl.int32)], dtype=(gl.float16,) * 4, is_pure=True, pack=2
    )


@gluon.jit
def _mma4(w, ws, x, xs, acc):
    w0, w1, w2, w3 = _decode(w, ws)
    x0, x1, x2, x3 = _decode(x, xs)
    acc = mma_v2(w0, x0, acc)
    acc = mma_v2(w1, x1, acc)
    acc = mma_v2(w2, x2, acc)
    return mma_v2(w3, x3, acc)


@gluon.jit
def _token_block(sorted_ptr, pid_m, num_slots, BLOCK_T: gl.constexpr, layout: gl.constexpr):
    offs_p = pid_m * BLOCK_T + gl.arange(0, BLOCK_T, layout=layout)
    slot = gl.load(sorted_ptr + offs_p)
    return offs_p, slot, slot < num_slots


@gluon.jit
def gate_up_kernel(
    a_ptr,  # x codes: uint8 [M, H/2]
    as_ptr,  # x block scales: uint8 [M, H/16]
    ag_ptr,  # x row scales: fp32 [M]
    w_ptr,  # W_gate_up codes: uint8 [E, 2I, H/2]
    ws_ptr,  # uint8 [E, 2I, H/16]
    wg_ptr,  # fp32 [E]
    h_ptr,  # out: SiLU(gate) * up, fp32 [P, I] by sorted position (padding rows 0); with SPLIT_K > 1 the raw
    # partial gate and up sums, fp32 [SPLIT_K, P, 2I], that `fp4_moe._silu_mul_kernel` finishes
    sorted_ptr,  # [P] int32 slot ids (token * top_k + k), num_slots for padding
    expert_ptr,  # [P / BLOCK_T] int32 expert of each token block, -1 past the end
    num_slots,
    top_k,
    H,
    NI,
    SPLIT_K: gl.constexpr,
    BLOCK_T: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    NUM_WARPS: gl.constexpr,
):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    pid_k = gl.program_id(2)
    e = gl.load(expert_ptr + pid_m)
    if e < 0:
        return
    KQ: gl.constexpr = BLOCK_K // 4
    k_len = H // SPLIT_K  # a slice of K per program (batch 1 has too few row blocks to fill the GPU)
    n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, la))
    k_off = pid_k * k_len
    kq = gl.arange(0, KQ, layout=gl.SliceLayout(0, la))
    g_rows = (e.to(gl.int64) * (2 * NI) + n)[:, None]
    g_ptrs = (w_ptr + k_off // 2).to(gl.pointer_type(gl.uint16), bitcast=True) + g_rows * (H // 4) + kq[None, :]
    gs_ptrs = (ws_ptr + k_off // 16) + g_rows * (H // 16) + (kq // 4)[None, :]
    u_off = NI * (H // 4)
    us_off = NI * (H // 16)
    offs_p, slot, valid = _token_block(sorted_ptr, pid_m, num_slots, BLOCK_T, gl.SliceLayout(0, lb))
    tok = gl.where(valid, slot // top_k, 0).to(gl.int64)[None, :]
    kb = gl.arange(0, KQ, layout=gl.SliceLayout(1, lb))[:, None]
    x_ptrs = (a_ptr + k_off // 2).to(gl.pointer_type(gl.uint16), bitcast=True) + tok * (H // 4) + kb
    xs_ptrs = (as_ptr + k_off // 16) + tok * (H // 16) + kb // 4
    acc_g = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, layout=mma)
    acc_u = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, layout=mma)
    # Software pipelining by hand (Gluon does not pipeline): the next K tile's loads are issued before this one's
    # decode and MMAs.
    g, gs = gl.load(g_ptrs), gl.load(gs_ptrs)
    u, us = gl.load(g_ptrs + u_off), gl.load(gs_ptrs + us_off)
    x, xs = gl.load(x_ptrs), gl.load(xs_ptrs)
    for k0 in range(BLOCK_K, k_len, BLOCK_K):
        g_n, gs_n = gl.load(g_ptrs + k0 // 4), gl.load(gs_ptrs + k0 // 16)
        u_n, us_n = gl.load(g_ptrs + (u_off + k0 // 4)), gl.load(gs_ptrs + (us_off + k0 // 16))
        x_n, xs_n = gl.load(x_ptrs + k0 // 4), gl.load(xs_ptrs + k0 // 16)
        acc_g = _mma4(g, gs, x, xs, acc_g)
        acc_u = _mma4(u, us, x, xs, acc_u)
        g, gs, u, us, x, xs = g_n, gs_n, u_n, us_n, x_n, xs_n
    acc_g = _mma4(g, gs, x, xs, acc_g)
    acc_u = _mma4(u, us, x, xs, acc_u)
    # Epilogue in a store-friendly layout: global scales (2^28 undoes the two 2^-14), SiLU(gate) * up.
    out_l: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [NUM_WARPS, 1], [0, 1])
    acc_g = gl.convert_layout(acc_g, out_l)
    acc_u = gl.convert_layout(acc_u, out_l)
    offs_p, slot, valid = _token_block(sorted_ptr, pid_m, num_slots, BLOCK_T, gl.SliceLayout(0, out_l))
    n_o = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_l))
    if SPLIT_K > 1:
        part = h_ptr + (pid_k * gl.num_programs(0) * BLOCK_T + offs_p).to(gl.int64)[None, :] * (2 * NI) + n_o[:, None]
        gl.store(part, acc_g * 268435456.0)
        gl.store(part + NI, acc_u * 268435456.0)
        return
    gx = gl.load(ag_ptr + gl.where(valid, slot // top_k, 0), mask=valid, other=0.0)
    scale = (gx * (gl.load(wg_ptr + e) * 268435456.0))[None, :]
    acc_g = acc_g * scale
    acc_u = acc_u * scale
    h = acc_g / (1.0 + gl.exp(-acc_g)) * acc_u
    h = gl.where(valid[None, :], h, 0.0)
    gl.store(h_ptr + offs_p.to(gl.int64)[None, :] * NI + n_o[:, None], h)


@gluon.jit
def down_kernel(
    a_ptr,  # h codes: uint8 [P, I/2] by sorted position
    as_ptr,  # uint8 [P, I/16]
    ag_ptr,  # fp32 [P]
    w_ptr,  # W_down codes: uint8 [E, H, I/2]
    ws_ptr,  # uint8 [E, H, I/16]
    wg_ptr,  # fp32 [E]
    tw_ptr,  # routing weights fp32 [num_slots]
    y_ptr,  # out: fp32 [num_slots, H], weighted expert outputs by slot
    sorted_ptr,
    expert_ptr,
    num_slots,
    H,
    NI,
    BLOCK_T: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    NUM_WARPS: gl.constexpr,
):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    e = gl.load(expert_ptr + pid_m)
    if e < 0:
        return
    KQ: gl.constexpr = BLOCK_K // 4
    n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, la))
    kq = gl.arange(0, KQ, layout=gl.SliceLayout(0, la))
    w_rows = (e.to(gl.int64) * H + n)[:, None]
    w_ptrs = w_ptr.to(gl.pointer_type(gl.uint16), bitcast=True) + w_rows * (NI // 4) + kq[None, :]
    ws_ptrs = ws_ptr + w_rows * (NI // 16) + (kq // 4)[None, :]
    offs_p, slot, valid = _token_block(sorted_ptr, pid_m, num_slots, BLOCK_T, gl.SliceLayout(0, lb))
    p = offs_p.to(gl.int64)[None, :]
    kb = gl.arange(0, KQ, layout=gl.SliceLayout(1, lb))[:, None]
    x_ptrs = a_ptr.to(gl.pointer_type(gl.uint16), bitcast=True) + p * (NI // 4) + kb
    xs_ptrs = as_ptr + p * (NI // 16) + kb // 4
    acc = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, layout=mma)
    w, ws = gl.load(w_ptrs), gl.load(ws_ptrs)
    x, xs = gl.load(x_ptrs), gl.load(xs_ptrs)
    for k0 in range(BLOCK_K, NI, BLOCK_K):
        w_n, ws_n = gl.load(w_ptrs + k0 // 4), gl.load(ws_ptrs + k0 // 16)
        x_n, xs_n = gl.load(x_ptrs + k0 // 4), gl.load(xs_ptrs + k0 // 16)
        acc = _mma4(w, ws, x, xs, acc)
        w, ws, x, xs = w_n, ws_n, x_n, xs_n
    acc = _mma4(w, ws, x, xs, acc)
    out_l: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [NUM_WARPS, 1], [0, 1])
    acc = gl.convert_layout(acc, out_l)
    offs_p, slot, valid = _token_block(sorted_ptr, pid_m, num_slots, BLOCK_T, gl.SliceLayout(0, out_l))
    scale = gl.load(ag_ptr + offs_p, mask=valid, other=0.0) * gl.load(tw_ptr + slot, mask=valid, other=0.0)
    acc = acc * (scale * (gl.load(wg_ptr + e) * 268435456.0))[None, :]
    n_o = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_l))
    out = y_ptr + gl.where(valid, slot, 0).to(gl.int64)[None, :] * H + n_o[:, None]
    gl.store(out, acc, mask=valid[None, :])
