# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""W4A4 routed-expert GEMMs for decode on Hopper, in Gluon: packed codes go from global memory straight into the
tensor-core operand registers, with no layout shuffle.

Why: the Triton kernels of `fp4_moe_triton` decode FP4 into a blocked layout and let the compiler move the values into the
MMA operand layout; on sm_90 that shuffle plus its address arithmetic costs about 7 instructions per weight element
and leaves the decode step instruction-bound at ~20% of copy bandwidth. Here the layouts are explicit:

* **Weights are the MMA's A operand** (``out^T = W @ x^T``, "swap AB"): the many weight rows fill the 16-row MMA
  tile and the few tokens of an expert fill its 8-wide N side, so a decode batch does not pad tokens to 16.
* **Each 32-bit word of packed codes is eight K-slices.** A thread of ``mma.m16n8k16`` holds pairs of consecutive K
  per register (``k_width=2``). Reading the packed codes as ``uint32`` words in exactly that operand layout, a
  register pair holds words ``w, w+1`` (one 8-byte load); `gluon_common.decode8` turns element ``j`` of both into an fp16 pair
  (two ``prmt`` put the words' low and high 16-bit halves side by side, then two shifts and two bit-selects per four
  elements and a shift and a mask per element: `nibbles_spread_ptx`), which *is* the operand register for K-slice
  ``j``. The MMA then sums ``sum_j sum_w W[n, 8w+j] x[8w+j]``, the whole dot product in another order; activations
  are decoded the same way, so their K order matches. The canonical `FP4Tensor` layout serves as is: no re-layout,
  nothing for export to convert.
* **Scales ride along.** Words ``w, w+1`` (``w`` even) are one NVFP4 block, so a register pair needs one scale byte:
  it is loaded once per pair in the ``k_width=1`` operand layout and doubled in registers (`pair_scales`), and one
  ``cvt.rn.f16x2.e4m3x2`` gives the multiplier pair.
* **Addresses in int64**, so that each register's address is the thread's base plus a constant and the loads use
  immediate offsets instead of per-element address arithmetic.
* **Two ways in for the weights.** Straight into registers, the next K tile's loads issued before this tile's MMAs;
  or (``STAGES`` >= 2, with the activations staged in shared memory) through a ``cp.async`` ring in shared memory,
  read from there into the same operand layouts: ``STAGES - 1`` tiles in flight without holding registers. The
  ring wins at batch 64 and loses at 16, where its shared memory leaves fewer programs per SM (docs/lab-notes.md
  2g). For batch 1's short down programs a third (`HOPPER` key ``early_weights``): the weights loaded (and decoded)
  before the PDL wait.

Values are exact as in `fp4_moe_triton` (``E2M1 * s * 2^-14`` has at most 6 significant bits and is >= 2^-24, fp16's
smallest subnormal; products of two are exact in fp32); only the summation order differs from torch's. About 2.6-4.2
instructions per weight element in the loops of the `HOPPER` entries instead of 7 (sm_90 SASS,
`benchmarks/kernels/sass_counts.py`; docs/lab-notes.md). `fp4_moe_wgmma` and `fp4_attention_hopper` use the same
decoding (`gluon_common`). GPU only (inline PTX; Gluon does not run in the interpreter); `fp4_moe.experts_from_quantized` picks these
kernels on sm_90+ for W4A4.
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.fp4_moe_hopper (see kernels/README.md), not kernels.fp4_moe_hopper.")

import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: E402

from trace_hf.fp4 import FP4Tensor  # noqa: E402
from trace_hf.kernels.fp4_moe_common import down_input, fp4_args, fused_hidden, gate_up_out  # noqa: E402
from trace_hf.kernels.fp4_moe_configs import check_hopper_entry  # noqa: E402
from trace_hf.kernels.gluon_common import (  # noqa: E402
    async_load,
    cta_barrier,
    decode8,
    down_store,
    gdc_wait_for_producer,
    pair_scales,
    quantize_token_block,
    silu_mul_store,
    token_block,
)
from trace_hf.kernels.moe_align import moe_align  # noqa: E402
from trace_hf.kernels.pdl import launch_options  # noqa: E402


#: `_stage_x`'s buffer: K-contiguous rows of 16-bit values, swizzled in 16-byte pieces so that the B-operand reads
#: (8 rows of 16 bytes at a time) hit distinct banks.
_X_SMEM = gl.constexpr(gl.SwizzledSharedLayout(8, 2, 4, [0, 1]))


@gluon.jit
def pair_scales_t(s, layout: gl.constexpr):
    """`pair_scales` along the rows: [R, C] to [2R, C] (the B operand, whose K runs down the rows)."""
    return gl.convert_layout(gl.reshape(gl.permute(gl.join(s, s), [0, 2, 1]), [2 * s.shape[0], s.shape[1]]), layout)


@gluon.jit
def _mma8(w, ws, x, xs, acc):
    wd = decode8(w, ws)
    xd = decode8(x, xs)
    for j in gl.static_range(8):
        acc = mma_v2(wd[j], xd[j], acc)
    return acc


@gluon.jit
def _stage_x(xsm, words_ptr, scale_ptr, rows, k_off, ROW_W: gl.constexpr, KW: gl.constexpr, K_TILES: gl.constexpr,
             NUM_WARPS: gl.constexpr):  # fmt: skip
    """Decode a program's activation rows ``rows`` ([T] int64, uint32 words from ``k_off // 8``, ``ROW_W`` words
    per row) once, all warps together, into ``xsm`` [K_TILES * 8, KW, T] fp16: entry ``8 * kt + j`` is slice ``j`` of
    K tile ``kt``, the B operand that `decode8` would give each warp."""
    ld: gl.constexpr = gl.BlockedLayout([2, 1], [4, 8], [NUM_WARPS, 1], [0, 1])  # a word pair (one block) per thread
    w = gl.arange(0, KW, layout=gl.SliceLayout(1, ld)).to(gl.int64)[:, None]
    rows = gl.convert_layout(rows, gl.SliceLayout(0, ld))[None, :]
    for kt in gl.static_range(K_TILES):
        kw = k_off // 8 + kt * KW + w
        xd = decode8(gl.load(words_ptr + (rows * ROW_W + kw)), gl.load(scale_ptr + (rows * (ROW_W // 2) + kw // 2)))
        for j in gl.static_range(8):
            xsm.index(kt * 8 + j).store(xd[j])


@gluon.jit
def _mma8_shared(w, ws, xsm, kt, lb: gl.constexpr, acc):
    """`_mma8` with the activation slices of K tile ``kt`` read from `_stage_x`'s buffer."""
    wd = decode8(w, ws)
    for j in gl.static_range(8):
        acc = mma_v2(wd[j], xsm.index(kt * 8 + j).load(lb), acc)
    return acc


@gluon.jit
def _ring_alloc(N_OPS: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, KW: gl.constexpr):
    """The weight ring of `_ring_copy`: per operand, code words [STAGES, BLOCK_N, KW] (swizzled in 16- or 32-byte
    pieces, so that the operand-layout reads, 8 rows of 32 bytes at a time, take the minimum of 2 wavefronts) and
    scale bytes [STAGES, BLOCK_N, KW / 2]."""
    words: gl.constexpr = (
        gl.SwizzledSharedLayout(4, 1, 8, [1, 0]) if KW >= 32 else gl.SwizzledSharedLayout(8, 2, 2, [1, 0])
    )
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    bufs = ()
    for i in gl.static_range(N_OPS):
        bufs = bufs + (
            gl.allocate_shared_memory(gl.uint32, [STAGES, BLOCK_N, KW], words),
            gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, KW // 2], flat),
        )
    return bufs


@gluon.jit
def _ring_offsets(row_w, BLOCK_N: gl.constexpr, KW: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Offsets of a K tile's rows for `_ring_copy` (``row_w`` code words per weight row): code words in 16-byte
    pieces, scale bytes in pieces of KW / 4 bytes (two per row), and the row of each piece."""
    lc: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (KW // 4), KW // 4], [NUM_WARPS, 1], [1, 0])
    ls: gl.constexpr = gl.BlockedLayout([1, KW // 4], [16, 2], [NUM_WARPS, 1], [1, 0])
    n_c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lc))[:, None]
    c_off = n_c.to(gl.int64) * row_w + gl.arange(0, KW, layout=gl.SliceLayout(0, lc)).to(gl.int64)[None, :]
    n_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ls))[:, None]
    s_off = n_s.to(gl.int64) * (row_w // 2) + gl.arange(0, KW // 2, layout=gl.SliceLayout(0, ls)).to(gl.int64)[None, :]
    return c_off, s_off, n_c + 0 * c_off.to(gl.int32), n_s + 0 * s_off.to(gl.int32)


@gluon.jit
def _ring_copy(bufs, slot, srcs, tile, offs, K_TILES: gl.constexpr, BLOCK_N: gl.constexpr, KW: gl.constexpr):
    """cp.async of K tile ``tile`` of each weight operand (``srcs``: (code words, scale bytes) pointers of the
    program's first tile) into ring slot ``slot``, one commit group; nothing is copied past the last tile."""
    c_off, s_off, r_c, r_s = offs
    rows = gl.where(tile < K_TILES, BLOCK_N, 0)
    for i in gl.static_range(len(srcs)):
        words, scales = srcs[i]
        async_load(bufs[2 * i].index(slot), words + (c_off + tile * KW), mask=r_c < rows)
        async_load(bufs[2 * i + 1].index(slot), scales + (s_off + tile * (KW // 2)), mask=r_s < rows)
    cp.commit_group()


@gluon.jit
def _ring_read(bufs, i: gl.constexpr, slot, la: gl.constexpr, la1: gl.constexpr):
    """Operand ``i``'s code words and paired scales of ring slot ``slot``, in the MMA operand layout."""
    return bufs[2 * i].index(slot).load(la), pair_scales(bufs[2 * i + 1].index(slot).load(la1), la)


@gluon.jit
def _gate_up_x_ptrs(a_ptr, as_ptr, sorted_ptr, pid_m, num_slots, top_k, k_off, H: gl.constexpr,
                    BLOCK_T: gl.constexpr, KW: gl.constexpr, lb: gl.constexpr, lb1: gl.constexpr):  # fmt: skip
    """Pointers to the first K tile of the gate/up program's activation rows (its token block's tokens; padding
    reads row 0): code words in the B operand layout, scale bytes in its k_width=1 layout."""
    offs_p, slot, valid = token_block(sorted_ptr, pid_m, num_slots, BLOCK_T, gl.SliceLayout(0, lb))
    tok = gl.where(valid, slot // top_k, 0).to(gl.int64)[None, :]
    offs_p1, slot1, valid1 = token_block(sorted_ptr, pid_m, num_slots, BLOCK_T, gl.SliceLayout(0, lb1))
    tok1 = gl.where(valid1, slot1 // top_k, 0).to(gl.int64)[None, :]
    x_ptrs = (
        a_ptr.to(gl.pointer_type(gl.uint32), bitcast=True)
        + k_off // 8
        + (tok * (H // 8) + gl.arange(0, KW, layout=gl.SliceLayout(1, lb)).to(gl.int64)[:, None])
    )
    xs_ptrs = (
        as_ptr
        + k_off // 16
        + (tok1 * (H // 16) + gl.arange(0, KW // 2, layout=gl.SliceLayout(1, lb1)).to(gl.int64)[:, None])
    )
    return x_ptrs, xs_ptrs


@gluon.jit
def _pin_to_shared(t):
    """Store ``t`` to a scratch buffer of shared memory that nothing reads. Why: ptxas moves no memory operation
    across the PDL wait or a barrier, so the loads (and the math) folded into ``t`` happen before that point;
    otherwise it would schedule them next to their first use."""
    gl.allocate_shared_memory(t.dtype, t.shape, gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).store(t)


@gluon.jit
def gate_up_kernel(
    a_ptr,  # x codes: uint8 [M, H/2]
    as_ptr,  # x block scales: uint8 [M, H/16]
    ag_ptr,  # x row scales: fp32 [M]
    w_ptr,  # W_gate_up codes: uint8 [E, 2I, H/2]
    ws_ptr,  # uint8 [E, 2I, H/16]
    wg_ptr,  # fp32 [E]
    h_ptr,  # out: SiLU(gate) * up, fp32 [P, I] by sorted position (padding rows 0); with SPLIT_K > 1 the raw
    # partial gate and up sums, fp32 [SPLIT_K, P, 2I], that `fp4_moe_common.down_input` finishes
    sorted_ptr,  # [P] int32 slot ids (token * top_k + k), num_slots for padding
    expert_ptr,  # [P / BLOCK_T] int32 expert of each token block, -1 past the end
    num_slots,
    top_k,
    H: gl.constexpr,
    NI: gl.constexpr,
    SPLIT_K: gl.constexpr,
    BLOCK_T: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    NUM_WARPS: gl.constexpr,
    X_SHARED: gl.constexpr,  # decode the activations once into shared memory (`_stage_x`), not in every warp
    STAGES: gl.constexpr,  # > 0: weights through a cp.async ring of this many K tiles (needs X_SHARED); 0: registers
    PDL: gl.constexpr,  # launched dependent on the previous kernel (`trace_hf.kernels.pdl`)
    # With SPLIT_K 1: the hidden's quantization in this launch (`quantize_token_block`) on a (column tiles, token
    # blocks) grid, a block's tiles side by side, so that its last one is not in the launch's last wave.
    FUSED_HIDDEN: gl.constexpr = False,
    hq_ptr=None,  # with FUSED_HIDDEN, out: codes uint8 [P, I/2], scale bytes [P, I/16], row scales fp32 [P]
    hs_ptr=None,
    hg_ptr=None,
    cnt_ptr=None,  # int32 [P / BLOCK_T], zeros
):
    gdc_wait_for_producer(PDL)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    la1: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=1)
    lb1: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=1)
    pid_m = gl.program_id(1 if FUSED_HIDDEN else 0)
    pid_n = gl.program_id(0 if FUSED_HIDDEN else 1)
    pid_k = gl.program_id(2)
    e = gl.load(expert_ptr + pid_m)
    if e < 0:
        return
    KW: gl.constexpr = BLOCK_K // 8  # uint32 code words per row of a K tile
    k_len = H // SPLIT_K  # a slice of K per program (batch 1 has too few row blocks to fill the GPU)
    k_off = pid_k * k_len
    # Offsets in int64, so that every register's address is the thread's base plus a constant (immediate offsets).
    g_rows = e.to(gl.int64) * (2 * NI) + pid_n * BLOCK_N
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, la)).to(gl.int64)[:, None]
    n1 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, la1)).to(gl.int64)[:, None]
    g_ptrs = (
        w_ptr.to(gl.pointer_type(gl.uint32), bitcast=True)
        + (g_rows * (H // 8) + k_off // 8)
        + (n * (H // 8) + gl.arange(0, KW, layout=gl.SliceLayout(0, la)).to(gl.int64)[None, :])
    )
    gs_ptrs = (
        ws_ptr
        + (g_rows * (H // 16) + k_off // 16)
        + (n1 * (H // 16) + gl.arange(0, KW // 2, layout=gl.SliceLayout(0, la1)).to(gl.int64)[None, :])
    )
    u_off = NI * (H // 8)
    us_off = NI * (H // 16)
    acc_g = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, layout=mma)
    acc_u = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, layout=mma)
    K_TILES: gl.constexpr = H // SPLIT_K // BLOCK_K
    if STAGES > 0:  # the weights come through a cp.async ring (activations in shared memory: X_SHARED)
        w0 = w_ptr.to(gl.pointer_type(gl.uint32), bitcast=True) + (g_rows * (H // 8) + k_off // 8)
        s0 = ws_ptr + (g_rows * (H // 16) + k_off // 16)
        srcs = ((w0, s0), (w0 + u_off, s0 + us_off))  # gate rows, up rows
        bufs = _ring_alloc(2, STAGES, BLOCK_N, KW)
        offs = _ring_offsets(H // 8, BLOCK_N, KW, NUM_WARPS)
        for st in gl.static_range(STAGES - 1):
            _ring_copy(bufs, st, srcs, st, offs, K_TILES, BLOCK_N, KW)
        xsm = gl.allocate_shared_memory(gl.float16, [K_TILES * 8, KW, BLOCK_T], _X_SMEM)
        _p, slot, valid = token_block(sorted_ptr, pid_m, num_slots, BLOCK_T, gl.SliceLayout(0, lb))
        rows = gl.where(valid, slot // top_k, 0).to(gl.int64)
        _stage_x(xsm, a_ptr.to(gl.pointer_type(gl.uint32), bitcast=True), as_ptr, rows, k_off, H // 8, KW, K_TILES,
                 NUM_WARPS)  # fmt: skip
        for kt in range(K_TILES):
            cta_barrier()  # every warp is done with the slot the next copy overwrites (and x is staged)
            _ring_copy(bufs, (kt + STAGES - 1) % STAGES, srcs, kt + STAGES - 1, offs, K_TILES, BLOCK_N, KW)
            cp.wait_group(STAGES - 1)
            cta_barrier()  # the copies of tile kt, by every thread, have landed
            g, gs = _ring_read(bufs, 0, kt % STAGES, la, la1)
            u, us = _ring_read(bufs, 1, kt % STAGES, la, la1)
            acc_g = _mma8_shared(g, gs, xsm, kt, lb, acc_g)
            acc_u = _mma8_shared(u, us, xsm, kt, lb, acc_u)
    elif X_SHARED:
        # Software pipelining by hand (Gluon does not pipeline): the next K tile's loads are issued before this
        # one's decode and MMAs.
        g, gs = gl.load(g_ptrs), gl.load(gs_ptrs)
        u, us = gl.load(g_ptrs + u_off), gl.load(gs_ptrs + us_off)
        xsm = gl.allocate_shared_memory(gl.float16, [K_TILES * 8, KW, BLOCK_T], _X_SMEM)
        _p, slot, valid = token_block(sorted_ptr, pid_m, num_slots, BLOCK_T, gl.SliceLayout(0, lb))
        rows = gl.where(valid, slot // top_k, 0).to(gl.int64)
        _stage_x(xsm, a_ptr.to(gl.pointer_type(gl.uint32), bitcast=True), as_ptr, rows, k_off, H // 8, KW, K_TILES,
                 NUM_WARPS)  # fmt: skip
        cta_barrier()
        for kt in range(1, K_TILES):
            k0 = kt * BLOCK_K
            g_n, gs_n = gl.load(g_ptrs + k0 // 8), gl.load(gs_ptrs + k0 // 16)
            u_n, us_n = gl.load(g_ptrs + (u_off + k0 // 8)), gl.load(gs_ptrs + (us_off + k0 // 16))
            acc_g = _mma8_shared(g, pair_scales(gs, la), xsm, kt - 1, lb, acc_g)
            acc_u = _mma8_shared(u, pair_scales(us, la), xsm, kt - 1, lb, acc_u)
            g, gs, u, us = g_n, gs_n, u_n, us_n
        acc_g = _mma8_shared(g, pair_scales(gs, la), xsm, K_TILES - 1, lb, acc_g)
        acc_u = _mma8_shared(u, pair_scales(us, la), xsm, K_TILES - 1, lb, acc_u)
    else:
        g, gs = gl.load(g_ptrs), gl.load(gs_ptrs)
        u, us = gl.load(g_ptrs + u_off), gl.load(gs_ptrs + us_off)
        x_ptrs, xs_ptrs = _gate_up_x_ptrs(a_ptr, as_ptr, sorted_ptr, pid_m, num_slots, top_k, k_off, H, BLOCK_T, KW,
                                          lb, lb1)  # fmt: skip
        x, xs = gl.load(x_ptrs), gl.load(xs_ptrs)
        for k0 in range(BLOCK_K, k_len, BLOCK_K):
            g_n, gs_n = gl.load(g_ptrs + k0 // 8), gl.load(gs_ptrs + k0 // 16)
            u_n, us_n = gl.load(g_ptrs + (u_off + k0 // 8)), gl.load(gs_ptrs + (us_off + k0 // 16))
            x_n, xs_n = gl.load(x_ptrs + k0 // 8), gl.load(xs_ptrs + k0 // 16)
            xs2 = pair_scales_t(xs, lb)
            acc_g = _mma8(g, pair_scales(gs, la), x, xs2, acc_g)
            acc_u = _mma8(u, pair_scales(us, la), x, xs2, acc_u)
            g, gs, u, us, x, xs = g_n, gs_n, u_n, us_n, x_n, xs_n
        xs2 = pair_scales_t(xs, lb)
        acc_g = _mma8(g, pair_scales(gs, la), x, xs2, acc_g)
        acc_u = _mma8(u, pair_scales(us, la), x, xs2, acc_u)
    # Epilogue in a store-friendly layout (`silu_mul_store`).
    out_l: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [NUM_WARPS, 1], [0, 1])
    acc_g = gl.convert_layout(acc_g, out_l)
    acc_u = gl.convert_layout(acc_u, out_l)
    offs_p, slot, valid = token_block(sorted_ptr, pid_m, num_slots, BLOCK_T, gl.SliceLayout(0, out_l))
    n_o = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_l))
    if SPLIT_K > 1:
        part = h_ptr + (pid_k * gl.num_programs(0) * BLOCK_T + offs_p).to(gl.int64)[None, :] * (2 * NI) + n_o[:, None]
        # Padding rows are not stored (at batch 1, 7 of every 8): `fp4_moe_common.down_input` does not read them.
        gl.store(part, acc_g * 268435456.0, mask=valid[None, :])
        gl.store(part + NI, acc_u * 268435456.0, mask=valid[None, :])
        return
    silu_mul_store(acc_g, acc_u, h_ptr, ag_ptr, wg_ptr, e, offs_p, slot, valid, n_o, top_k, NI)
    if FUSED_HIDDEN:
        quantize_token_block(h_ptr, hq_ptr, hs_ptr, hg_ptr, cnt_ptr, sorted_ptr, num_slots, pid_m, NI // BLOCK_N,
                             BLOCK_T, NI, NUM_WARPS)  # fmt: skip


@gluon.jit
def _down_x_ptrs(a_ptr, as_ptr, p0, k_off, NI: gl.constexpr, BLOCK_T: gl.constexpr, KW: gl.constexpr,
                 lb: gl.constexpr, lb1: gl.constexpr):  # fmt: skip
    """Pointers to the first K tile of the down program's hidden rows (from ``p0``): code words in the B operand
    layout, scale bytes in its k_width=1 layout (`pair_scales_t` doubles them)."""
    p = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, lb)).to(gl.int64)[None, :]
    p1 = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, lb1)).to(gl.int64)[None, :]
    x_ptrs = (
        a_ptr.to(gl.pointer_type(gl.uint32), bitcast=True)
        + (p0 * (NI // 8) + k_off // 8)
        + (p * (NI // 8) + gl.arange(0, KW, layout=gl.SliceLayout(1, lb)).to(gl.int64)[:, None])
    )
    xs_ptrs = (
        as_ptr
        + (p0 * (NI // 16) + k_off // 16)
        + (p1 * (NI // 16) + gl.arange(0, KW // 2, layout=gl.SliceLayout(1, lb1)).to(gl.int64)[:, None])
    )
    return x_ptrs, xs_ptrs


@gluon.jit
def _down_early_weights(w_ptrs, ws_ptrs, a_ptr, as_ptr, p0, k_off, acc, NI: gl.constexpr, K_TILES: gl.constexpr,
                        BLOCK_N: gl.constexpr, BLOCK_T: gl.constexpr, KW: gl.constexpr, EARLY: gl.constexpr,
                        PDL: gl.constexpr, la: gl.constexpr, lb: gl.constexpr, lb1: gl.constexpr):  # fmt: skip
    """`down_kernel`'s main loop with every weight tile of the program loaded (``EARLY`` 1), or loaded and decoded
    into its MMA operands (2), before its PDL wait; then the same MMAs in the same order (the same bits). Why: at
    batch 1 the down programs are short latency chains and the SiLU + quantization kernel before them runs on a
    nearly idle GPU; launched early under PDL, they fetch (and decode: 2/3 of their instructions) their weights
    meanwhile. Safe: the weights are constant, and the expert ids were written before the gate/up kernel ran, which
    has finished once this kernel runs at all (its predecessor, like every PDL kernel here, lets it be scheduled
    only after its own wait, i.e. after the gate/up kernel ended). The activations (the hidden, written by the
    predecessor) are read after the wait (ptxas places those loads next to their MMAs, as in the loop)."""
    tiles = ()
    for kt in gl.static_range(K_TILES):
        tiles = tiles + ((gl.load(w_ptrs + kt * KW), gl.load(ws_ptrs + kt * (KW // 2))),)
    wds = ()
    if EARLY == 2:
        # The decoding too, folded into a `_pin_to_shared` store ahead of the wait.
        pin = gl.zeros([BLOCK_N, KW], gl.int16, layout=la)
        for kt in gl.static_range(K_TILES):
            w, ws = tiles[kt]
            wd = decode8(w, pair_scales(ws, la))
            wds = wds + (wd,)
            for j in gl.static_range(8):
                pin = pin ^ wd[j].to(gl.int16, bitcast=True)
        _pin_to_shared(pin)
    gdc_wait_for_producer(PDL)
    x_ptrs, xs_ptrs = _down_x_ptrs(a_ptr, as_ptr, p0, k_off, NI, BLOCK_T, KW, lb, lb1)
    xt = ()
    for kt in gl.static_range(K_TILES):
        xt = xt + ((gl.load(x_ptrs + kt * KW), gl.load(xs_ptrs + kt * (KW // 2))),)
    for kt in gl.static_range(K_TILES):
        x, xs = xt[kt]
        if EARLY == 2:
            xd = decode8(x, pair_scales_t(xs, lb))
            wd = wds[kt]
            for j in gl.static_range(8):
                acc = mma_v2(wd[j], xd[j], acc)
        else:
            w, ws = tiles[kt]
            acc = _mma8(w, pair_scales(ws, la), x, pair_scales_t(xs, lb), acc)
    return acc


@gluon.jit
def down_kernel(
    a_ptr,  # h codes: uint8 [P, I/2] by sorted position
    as_ptr,  # uint8 [P, I/16]
    ag_ptr,  # fp32 [P]
    w_ptr,  # W_down codes: uint8 [E, H, I/2]
    ws_ptr,  # uint8 [E, H, I/16]
    wg_ptr,  # fp32 [E]
    tw_ptr,  # routing weights fp32 [num_slots]
    y_ptr,  # out: fp32 [num_slots, SPLIT_K, H], weighted expert outputs by slot (with SPLIT_K > 1, partial sums)
    sorted_ptr,
    expert_ptr,
    num_slots,
    H: gl.constexpr,
    NI: gl.constexpr,
    SPLIT_K: gl.constexpr,  # programs per tile over slices of K (batch 1); the outputs' reader adds the partial sums
    BLOCK_T: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    NUM_WARPS: gl.constexpr,
    X_SHARED: gl.constexpr,
    STAGES: gl.constexpr,
    PDL: gl.constexpr,
    EARLY_WEIGHTS: gl.constexpr = 0,  # 1: weights loaded before the PDL wait, 2: also decoded (`_down_early_weights`)
):
    if not EARLY_WEIGHTS:
        gdc_wait_for_producer(PDL)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    la1: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=1)
    lb1: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=1)
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    pid_k = gl.program_id(2)
    e = gl.load(expert_ptr + pid_m)
    if e < 0:
        return
    KW: gl.constexpr = BLOCK_K // 8
    K_LEN: gl.constexpr = NI // SPLIT_K
    k_off = pid_k * K_LEN
    w_rows = e.to(gl.int64) * H + pid_n * BLOCK_N
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, la)).to(gl.int64)[:, None]
    n1 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, la1)).to(gl.int64)[:, None]
    w_ptrs = (
        w_ptr.to(gl.pointer_type(gl.uint32), bitcast=True)
        + (w_rows * (NI // 8) + k_off // 8)
        + (n * (NI // 8) + gl.arange(0, KW, layout=gl.SliceLayout(0, la)).to(gl.int64)[None, :])
    )
    ws_ptrs = (
        ws_ptr
        + (w_rows * (NI // 16) + k_off // 16)
        + (n1 * (NI // 16) + gl.arange(0, KW // 2, layout=gl.SliceLayout(0, la1)).to(gl.int64)[None, :])
    )
    p0 = pid_m.to(gl.int64) * BLOCK_T
    acc = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, layout=mma)
    K_TILES: gl.constexpr = K_LEN // BLOCK_K
    if EARLY_WEIGHTS:
        acc = _down_early_weights(w_ptrs, ws_ptrs, a_ptr, as_ptr, p0, k_off, acc, NI, K_TILES, BLOCK_N, BLOCK_T, KW,
                                  EARLY_WEIGHTS, PDL, la, lb, lb1)  # fmt: skip
    elif STAGES > 0:  # the ring of `gate_up_kernel`
        srcs = (
            (
                w_ptr.to(gl.pointer_type(gl.uint32), bitcast=True) + (w_rows * (NI // 8) + k_off // 8),
                ws_ptr + (w_rows * (NI // 16) + k_off // 16),
            ),
        )
        bufs = _ring_alloc(1, STAGES, BLOCK_N, KW)
        offs = _ring_offsets(NI // 8, BLOCK_N, KW, NUM_WARPS)
        for st in gl.static_range(STAGES - 1):
            _ring_copy(bufs, st, srcs, st, offs, K_TILES, BLOCK_N, KW)
        xsm = gl.allocate_shared_memory(gl.float16, [K_TILES * 8, KW, BLOCK_T], _X_SMEM)
        rows = p0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, lb)).to(gl.int64)
        _stage_x(xsm, a_ptr.to(gl.pointer_type(gl.uint32), bitcast=True), as_ptr, rows, k_off, NI // 8, KW, K_TILES,
                 NUM_WARPS)  # fmt: skip
        for kt in range(K_TILES):
            cta_barrier()
            _ring_copy(bufs, (kt + STAGES - 1) % STAGES, srcs, kt + STAGES - 1, offs, K_TILES, BLOCK_N, KW)
            cp.wait_group(STAGES - 1)
            cta_barrier()
            w, ws = _ring_read(bufs, 0, kt % STAGES, la, la1)
            acc = _mma8_shared(w, ws, xsm, kt, lb, acc)
    elif X_SHARED:
        w, ws = gl.load(w_ptrs), gl.load(ws_ptrs)
        xsm = gl.allocate_shared_memory(gl.float16, [K_TILES * 8, KW, BLOCK_T], _X_SMEM)
        rows = p0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, lb)).to(gl.int64)
        _stage_x(xsm, a_ptr.to(gl.pointer_type(gl.uint32), bitcast=True), as_ptr, rows, k_off, NI // 8, KW, K_TILES,
                 NUM_WARPS)  # fmt: skip
        cta_barrier()
        for kt in range(1, K_TILES):
            w_n, ws_n = gl.load(w_ptrs + kt * KW), gl.load(ws_ptrs + kt * (KW // 2))
            acc = _mma8_shared(w, pair_scales(ws, la), xsm, kt - 1, lb, acc)
            w, ws = w_n, ws_n
        acc = _mma8_shared(w, pair_scales(ws, la), xsm, K_TILES - 1, lb, acc)
    else:
        w, ws = gl.load(w_ptrs), gl.load(ws_ptrs)
        x_ptrs, xs_ptrs = _down_x_ptrs(a_ptr, as_ptr, p0, k_off, NI, BLOCK_T, KW, lb, lb1)
        x, xs = gl.load(x_ptrs), gl.load(xs_ptrs)
        for k0 in range(BLOCK_K, K_LEN, BLOCK_K):
            w_n, ws_n = gl.load(w_ptrs + k0 // 8), gl.load(ws_ptrs + k0 // 16)
            x_n, xs_n = gl.load(x_ptrs + k0 // 8), gl.load(xs_ptrs + k0 // 16)
            acc = _mma8(w, pair_scales(ws, la), x, pair_scales_t(xs, lb), acc)
            w, ws, x, xs = w_n, ws_n, x_n, xs_n
        acc = _mma8(w, pair_scales(ws, la), x, pair_scales_t(xs, lb), acc)
    out_l: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [NUM_WARPS, 1], [0, 1])
    acc = gl.convert_layout(acc, out_l)
    offs_p, slot, valid = token_block(sorted_ptr, pid_m, num_slots, BLOCK_T, gl.SliceLayout(0, out_l))
    down_store(acc, y_ptr, ag_ptr, tw_ptr, wg_ptr, e, offs_p, slot, valid, pid_n, pid_k, H, BLOCK_N, SPLIT_K, out_l)


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------


def experts(cfg, xq, topk_ids, topk_weights, w_gate_up, w_down, align_backend, return_hidden):
    """`fp4_moe.experts_from_quantized` through these kernels with the `HOPPER` entry ``cfg`` (W4A4, sm_90+, tiles
    that divide the shapes): same steps, same outputs as the Triton kernels. ``xq``, ``w_gate_up``, ``w_down``:
    NVFP4 `FP4Tensor`."""
    x, xs, xg, _ = fp4_args(xq)
    wgu, wgus, wgug, _ = fp4_args(w_gate_up)
    wd, wds, wdg, _ = fp4_args(w_down)
    E, H, NI = w_gate_up.shape[0], w_gate_up.shape[2], w_gate_up.shape[1] // 2
    M, K = topk_ids.shape
    sorted_ids, expert_ids = moe_align(topk_ids, E, cfg["block_t"], align_backend)
    n, bt, nw, bk = M * K, cfg["block_t"], cfg["num_warps"], cfg["block_k"]
    P = sorted_ids.numel()
    split = cfg.get("split_k", 1)
    while split > 1 and H % (split * bk):
        split //= 2
    part = gate_up_out(split, P, NI, x.device)
    stages = check_hopper_entry(cfg)
    cap, cap_down = cfg.get("maxnreg"), cfg.get("maxnreg_down") or cfg.get("maxnreg")
    regs, regs_down = ({"maxnreg": c} if c else {} for c in (cap, cap_down))
    fused, grid = fused_hidden(cfg, return_hidden or split > 1, P, NI, bt, cfg["block_n_gate_up"], x.device)
    gate_up_kernel[grid + (split,)](
        x, xs, xg, wgu, wgus, wgug, part, sorted_ids, expert_ids, n, K, H, NI,
        SPLIT_K=split, BLOCK_T=bt, BLOCK_N=cfg["block_n_gate_up"], BLOCK_K=bk, NUM_WARPS=nw,
        X_SHARED=cfg.get("x_shared", False), STAGES=stages, num_warps=nw,
        enable_fp_fusion=True, **fused, **regs, **launch_options(x.device),
    )  # fmt: skip
    if fused:
        hq, hidden = FP4Tensor(fused["hq_ptr"], fused["hs_ptr"], fused["hg_ptr"], "nvfp4"), None
    else:
        hq, hidden = down_input(part, xg, wgug, sorted_ids, expert_ids, n, K, bt, True, True, True, return_hidden)
    split_down = cfg.get("split_k_down", 1)
    while split_down > 1 and NI % (split_down * bk):
        split_down -= 1
    y = torch.empty(M, K * split_down, H, dtype=torch.float32, device=x.device)  # each slot's partial sums in a row
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    down_kernel[(P // bt, H // cfg["block_n_down"], split_down)](
        hq.packed, hq.block_scale, hq.global_scale.reshape(-1), wd, wds, wdg, tw, y, sorted_ids, expert_ids, n, H, NI,
        SPLIT_K=split_down, BLOCK_T=bt, BLOCK_N=cfg["block_n_down"], BLOCK_K=bk, NUM_WARPS=nw,
        X_SHARED=cfg.get("x_shared", False), STAGES=stages, EARLY_WEIGHTS=int(cfg.get("early_weights", 0)),
        num_warps=nw, enable_fp_fusion=True, **regs_down, **launch_options(x.device),
    )  # fmt: skip
    return y, hidden
