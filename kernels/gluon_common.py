# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""What the Gluon kernels (`fp4_moe_hopper`, `fp4_moe_wgmma`, `fp4_attention_hopper`) share, one definition each:
the FP4 decoding straight into MMA operand registers (`decode8`, its PTX, `pair_scales`), the PDL wait, the
``cp.async`` copy and barrier across Triton versions, and the routed experts' token blocks and epilogues (the decode
and the wgmma kernels compute the same function, so they share them).

Why a module of its own: `common` is imported by every kernel, also where this Triton lacks Gluon's pieces (the
interpreter, older Triton); the Gluon kernel modules are imported through `common.gluon_module`, which falls back
when this import fails. The op modules import from here and export nothing to each other.
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.gluon_common (see kernels/README.md), not kernels.gluon_common.")

from triton import next_power_of_2  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

from trace_hf.kernels.fp4_quant import nvfp4_row_codes  # noqa: E402


def scale_pair_ptx(lo: str, hi: str) -> list[str]:
    """PTX lines: the E4M3 bytes in registers ``lo`` and ``hi`` to the fp16 pair ``sc`` = (lo, hi), in hardware
    (0x7F stays NaN). Needs ``.reg .b32 sc; .reg .b16 sl, sh;``."""
    return [f"prmt.b32 sc, {lo}, {hi}, 0x40;", "mov.b32 {sl, sh}, sc;", "cvt.rn.f16x2.e4m3x2 sc, sl;"]


def nibbles_spread_ptx(src: str, outs: list[str]) -> list[str]:
    """PTX lines: nibble j of both 16-bit halves of register ``src`` to the fp16 pair ``outs[j]``, times the fp16
    pair ``sc``. A nibble's magnitude bits go under the fp16 exponent's low bits (bits 9-11: value E2M1 * 2^-14,
    code 1 an fp16 subnormal), its sign to bit 15; both halves move with the same shift because they are 16 bits
    apart. That puts the sign 6 bits above the magnitude's lowest bit, where the code has it 3 above: one bit-select
    (``lop3``) per two nibbles builds a register where the gap is 6 for nibbles 0 and 2 (magnitudes in place, signs
    from ``src << 3``) or 1 and 3 (magnitudes from ``src >> 3``, signs in place), without collisions, so that each
    pair is one shift and one mask of it: 11 integer instructions per four fp16 pairs. Needs ``.reg .b32 m, s;`` (``s``:
    the even register; ``m``, the odd one, is read by the pair of nibble 3 last)."""
    sel = "0xE4"  # lop3's table for (a & c) | (b & ~c), the bit-select
    lines = [f"shl.b32 m, {src}, 3;", f"lop3.b32 s, {src}, m, 0x07070707, {sel};",
             f"shr.b32 m, {src}, 3;", f"lop3.b32 m, m, {src}, 0x0E0E0E0E, {sel};"]  # fmt: skip
    for out, reg, shift in ((outs[0], "s", 9), (outs[2], "s", 1), (outs[1], "m", 8)):
        lines += [f"shl.b32 {out}, {reg}, {shift};", f"and.b32 {out}, {out}, 0x8E008E00;"]
        lines.append(f"mul.rn.f16x2 {out}, {out}, sc;")
    return lines + ["and.b32 m, m, 0x8E008E00;", f"mul.rn.f16x2 {outs[3]}, m, sc;"]


def _decode8_ptx() -> str:
    """PTX: a register pair of uint32 code words ($8, $9) and their E4M3 scale bytes ($10, $11) to eight fp16 pairs
    ($0..$7), pair j = (element j of word $8, element j of word $9) * (s_8, s_9) * 2^-14. One ``prmt`` puts the low
    16 bits of both words in one register (elements 0-3), another the high 16 bits (elements 4-7); then
    `nibbles_spread_ptx`."""
    head = ["{", ".reg .b32 m, s, sc, p;", ".reg .b16 sl, sh;"] + scale_pair_ptx("$10", "$11")
    lo = ["prmt.b32 p, $8, $9, 0x5410;"] + nibbles_spread_ptx("p", ["$0", "$1", "$2", "$3"])
    hi = ["prmt.b32 p, $8, $9, 0x7632;"] + nibbles_spread_ptx("p", ["$4", "$5", "$6", "$7"])
    return "\n".join(head + lo + hi + ["}"])


_DECODE8_PTX = gl.constexpr(_decode8_ptx())


@gluon.jit
def gdc_wait_for_producer(PDL: gl.constexpr):
    """`trace_hf.kernels.pdl.wait_for_producer` for Gluon kernels."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


#: cp.async's global-to-shared copy: ``async_load`` from Triton 3.7 on, ``async_copy_global_to_shared`` before (3.6 is
#: what the H200 image has).
async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared


#: A barrier of the program's warps: ``gl.thread_barrier`` up to Triton 3.6 (the H200 image), ``gl.barrier`` later.
cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def decode8(words, scales):
    """uint32 code words and their uint8 block-scale bytes (same layout, consecutive pairs in one register pair of
    the MMA operand) to the eight fp16 slices ``E2M1 * s * 2^-14`` (slice j: element j of each word), by
    `_decode8_ptx`."""
    return gl.inline_asm_elementwise(
        _DECODE8_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [words, scales.to(gl.int32)], dtype=(gl.float16,) * 8,
        is_pure=True, pack=2,
    )  # fmt: skip


@gluon.jit
def pair_scales(s, layout: gl.constexpr):
    """Scale bytes ``s`` [R, C] loaded one per word pair in the k_width=1 operand layout (a thread holds columns
    q, q + 4, ...) to [R, 2C], each byte twice, in the k_width=2 layout ``layout`` (columns 2q, 2q + 1, ...): a
    register-only reshuffle, no data movement."""
    return gl.convert_layout(gl.reshape(gl.join(s, s), [s.shape[0], 2 * s.shape[1]]), layout)


@gluon.jit
def quantize_token_block(h_ptr, q_ptr, sb_ptr, g_ptr, cnt_ptr, sorted_ptr, num_slots, block, n_progs,
                         BLOCK_T: gl.constexpr, NI: gl.constexpr, NUM_WARPS: gl.constexpr):  # fmt: skip
    """The hidden activation's quantization inside the gate/up launch (``fused_hidden``): called by every program
    after it stored its fp32 tile of token block ``block``; the last of the block's ``n_progs`` programs to get
    here (a counter per block, ``cnt_ptr``, zero before the launch) reads the block's rows back (from L2) and writes
    them as ``fp4_quant.quantize(h, "nvfp4", "row")`` would (codes, scale bytes, row scales, by
    `fp4_quant.nvfp4_row_codes`: the same bits). Only the rows of real slots: a block's padding rows (and the rows of
    blocks past the last segment) are left unwritten, and nothing reads them as numbers (the down kernels' padding
    columns are dropped, each MMA column is its own token's). Why: the separate launch over all [P, I] fp32 rows
    runs at ~4x its bytes' time (a short dependent chain per program), and rows are whole only once every column
    tile is done. The kernels keep FMA contraction on (so the gate/up epilogue is that of the unfused launch, bit for
    bit): the quantization's float arithmetic has no multiply feeding an add (its FMAs are explicit, its divisions
    correctly rounded), so contraction leaves it as `fp4_quant._fp4_kernel` computes it."""
    cta_barrier()  # every warp's stores of the tile come before the release of the counter
    done = gl.atomic_add(cnt_ptr + block, 1, sem="acq_rel", scope="gpu")
    if done == n_progs - 1:
        NB: gl.constexpr = NI // 16
        NBT: gl.constexpr = next_power_of_2(NB)  # (a constexpr function in Triton)
        # A thread holds one NVFP4 block (16 values); lanes, then warps, along a row's blocks; R rows at a time.
        TB: gl.constexpr = min(32, NBT)
        WB: gl.constexpr = min(NUM_WARPS, max(1, NBT // 32))
        R: gl.constexpr = (32 // TB) * (NUM_WARPS // WB)
        l3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [32 // TB, TB, 1], [NUM_WARPS // WB, WB, 1], [2, 1, 0])
        lr: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, l3))
        r = gl.arange(0, R, layout=lr)
        b = gl.arange(0, NBT, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))
        e = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
        # Real slots come first in a block (`moe_align`): rows 0 .. n - 1.
        t = block * BLOCK_T + gl.arange(0, BLOCK_T, layout=lr)
        n = gl.sum((gl.load(sorted_ptr + t) < num_slots).to(gl.int32), axis=0)
        col = b[None, :, None] * 16 + e[None, None, :]
        byte = b[None, :, None] * 8 + e[None, None, :] // 2
        base = block.to(gl.int64) * BLOCK_T
        # .cg: the peers' rows come from L2, never from a line this SM's L1 kept from an earlier call. The next
        # rows' load goes out before this one's arithmetic.
        bmask = (b < NB)[None, :] & (r < n)[:, None]
        x = gl.load(h_ptr + ((base + r)[:, None, None] * NI + col), mask=bmask[:, :, None] & (e >= 0)[None, None, :],
                    other=0.0, cache_modifier=".cg")  # fmt: skip
        for r0 in range(0, n, R):
            rows = base + r0 + r
            bmask = (b < NB)[None, :] & (r0 + r < n)[:, None]
            mask = bmask[:, :, None] & (e >= 0)[None, None, :]
            nmask = ((b < NB)[None, :] & (r0 + R + r < n)[:, None])[:, :, None] & (e >= 0)[None, None, :]
            x_next = gl.load(h_ptr + ((rows + R)[:, None, None] * NI + col), mask=nmask, other=0.0,
                             cache_modifier=".cg")  # fmt: skip
            code, sbyte, g = nvfp4_row_codes(x)
            gl.store(g_ptr + rows, g, mask=r0 + r < n)
            gl.store(sb_ptr + (rows[:, None] * NB + b[None, :]), sbyte.to(gl.uint8), mask=bmask)
            # Element 2i in the low nibble, 2i + 1 in the high one (`fp4_quant._store_codes`).
            lo, hi = gl.split(gl.reshape(code, [R, NBT, 8, 2]))
            offs, _ = gl.split(gl.reshape(rows[:, None, None] * (NI // 2) + byte, [R, NBT, 8, 2]))
            m, _ = gl.split(gl.reshape(mask, [R, NBT, 8, 2]))
            gl.store(q_ptr + offs, (lo | (hi << 4)).to(gl.uint8), mask=m)
            x = x_next


@gluon.jit
def token_block(sorted_ptr, pid_m, num_slots, BLOCK_T: gl.constexpr, layout: gl.constexpr):
    """Token block ``pid_m``'s sorted positions, their slot ids and which are real slots (not padding)."""
    offs_p = pid_m * BLOCK_T + gl.arange(0, BLOCK_T, layout=layout)
    slot = gl.load(sorted_ptr + offs_p)
    return offs_p, slot, slot < num_slots


@gluon.jit
def silu_mul_store(acc_g, acc_u, h_ptr, ag_ptr, wg_ptr, e, offs_p, slot, valid, n_o, top_k, NI: gl.constexpr):
    """The gate/up epilogue of the Gluon expert kernels, on accumulators in a store layout (tokens along its columns:
    sorted positions ``offs_p``, slots ``slot``, ``valid`` for real slots; hidden columns ``n_o`` along its rows):
    the global scales (2^28 undoes the two 2^-14 of the decoded operands), SiLU(gate) * up, padding columns 0,
    stored by sorted position."""
    gx = gl.load(ag_ptr + gl.where(valid, slot // top_k, 0), mask=valid, other=0.0)
    scale = (gx * (gl.load(wg_ptr + e) * 268435456.0))[None, :]
    acc_g = acc_g * scale
    acc_u = acc_u * scale
    h = acc_g / (1.0 + gl.exp(-acc_g)) * acc_u
    h = gl.where(valid[None, :], h, 0.0)
    gl.store(h_ptr + offs_p.to(gl.int64)[None, :] * NI + n_o[:, None], h)


@gluon.jit
def down_store(acc, y_ptr, ag_ptr, tw_ptr, wg_ptr, e, offs_p, slot, valid, pid_n, pid_k, H: gl.constexpr,
               BLOCK_N: gl.constexpr, SPLIT_K: gl.constexpr, out_l: gl.constexpr):  # fmt: skip
    """The down epilogue of the Gluon expert kernels, on the accumulator in the store layout ``out_l`` (tokens along
    its columns, as in `silu_mul_store`): the hidden's row scale, the routing weight and the weights' global scale
    (times 2^28), each real slot's row written (split ``pid_k`` of ``SPLIT_K`` side by side in it)."""
    scale = gl.load(ag_ptr + offs_p, mask=valid, other=0.0) * gl.load(tw_ptr + slot, mask=valid, other=0.0)
    acc = acc * (scale * (gl.load(wg_ptr + e) * 268435456.0))[None, :]
    n_o = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_l))
    out = y_ptr + (gl.where(valid, slot, 0).to(gl.int64) * SPLIT_K + pid_k)[None, :] * H + n_o[:, None]
    gl.store(out, acc, mask=valid[None, :])
