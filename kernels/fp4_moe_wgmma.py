# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""W4A4 routed-expert GEMMs on Hopper with warpgroup MMA (wgmma), for calls where an expert serves many tokens:
decode at large batches (thousands of slots) and prefill or training forwards (tens of thousands).

Why: the decode kernels of `fp4_moe_hopper` use 8-token expert blocks (``mma.sync``, N = 8), so an expert that
serves 32 tokens decodes its weights 4 times, and past 1,024 slots the Triton kernels ran, with their ~7
instructions per weight element. Here a program owns a wide token block (``BLOCK_T`` 16-64, the MMA's N):

* **Weights are wgmma's A operand, straight from registers.** The code words are loaded as ``uint32`` in the
  wgmma register-operand layout (per warp the same as ``mma.sync``'s A fragment, ``k_width=2``), and
  `gluon_common.decode8` turns a register pair into the eight fp16 K-slices, as in the decode kernels: each
  weight element is decoded once per token block, not once per 8 tokens.
* **Activations are decoded once per K tile into shared memory** (wgmma's B operand must be there), all warps
  together, in the same K-slice order (slice j of a tile: element j of every code word), into a double buffer, so
  the next tile's activations are decoded while this tile's MMAs run (``is_async``).

Values are exact as in the other kernels (``E2M1 * s * 2^-14`` in fp16; products exact in fp32), only the fp32
summation order differs from torch's; the epilogues (global scales, SiLU * up; routing weight) are the decode kernels'
(`gluon_common`). GPU only (inline PTX, Gluon); `fp4_moe.experts_from_quantized` picks these kernels on sm_90+
through `fp4_moe_configs.WGMMA` (by slots per expert).
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.fp4_moe_wgmma (see kernels/README.md), not kernels.fp4_moe_wgmma.")

import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from trace_hf.fp4 import FP4Tensor  # noqa: E402
from trace_hf.kernels.fp4_moe_common import down_input, fp4_args, fused_hidden, gate_up_out  # noqa: E402
from trace_hf.kernels.fp4_moe_configs import gate_up_cap  # noqa: E402
from trace_hf.kernels.gluon_common import (  # noqa: E402
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


@gluon.jit
def _x_load(words_ptr, scale_ptr, w_off, s_off, kt, KW: gl.constexpr):
    """K tile ``kt`` of the activation rows whose offsets are ``w_off`` (words) and ``s_off`` (scale bytes)."""
    return gl.load(words_ptr + (w_off + kt * KW)), gl.load(scale_ptr + (s_off + kt * (KW // 2)))


@gluon.jit
def _x_slice(bufs, base, j: gl.constexpr, SLICE_BUFFERS: gl.constexpr):
    """K-slice ``j`` of the half of the activation double buffer `_x_smem` that starts at slice ``base`` (0 or 8):
    [T, KW] fp16."""
    if SLICE_BUFFERS:
        return bufs[j].index(base // 8)
    else:
        return bufs[0].index(base + j)


@gluon.jit
def _x_store(bufs, base, words, scales, lw: gl.constexpr, SLICE_BUFFERS: gl.constexpr):
    """Decode an activation tile ([T, KW] words, [T, KW / 2] scale bytes) into slices ``base .. base + 7`` of the
    double buffer ([T, KW] fp16 each, K-major: wgmma's B operand, transposed)."""
    s2 = gl.convert_layout(gl.reshape(gl.join(scales, scales), [scales.shape[0], 2 * scales.shape[1]]), lw)
    xd = decode8(words, s2)
    for j in gl.static_range(8):
        _x_slice(bufs, base, j, SLICE_BUFFERS).store(xd[j])


@gluon.jit
def _w_offsets(rows0, row_w, BLOCK_N: gl.constexpr, KW: gl.constexpr, la: gl.constexpr, la1: gl.constexpr):
    """int64 offsets of a weight K tile in the wgmma A-operand layouts: code words [BLOCK_N, KW] and scale bytes
    [BLOCK_N, KW / 2] of rows ``rows0 ..`` (``row_w`` code words per row)."""
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, la)).to(gl.int64)[:, None]
    n1 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, la1)).to(gl.int64)[:, None]
    w = rows0 * row_w + (n * row_w + gl.arange(0, KW, layout=gl.SliceLayout(0, la)).to(gl.int64)[None, :])
    s = rows0 * (row_w // 2) + (
        n1 * (row_w // 2) + gl.arange(0, KW // 2, layout=gl.SliceLayout(0, la1)).to(gl.int64)[None, :]
    )
    return w, s


@gluon.jit
def _mma_tile(wd, bufs, base, acc, SLICE_BUFFERS: gl.constexpr):
    """acc + the eight K-slices of a tile: A the decoded weight slices (registers), B the staged activations."""
    for j in gl.static_range(8):
        acc = warpgroup_mma(wd[j], _x_slice(bufs, base, j, SLICE_BUFFERS).permute((1, 0)), acc, is_async=True)
    return acc


@gluon.jit
def _x_smem(BLOCK_T: gl.constexpr, KW: gl.constexpr, SLICE_BUFFERS: gl.constexpr):
    """The activation double buffer: 2 x 8 K-slices of [BLOCK_T, KW] fp16, K contiguous (32 or 64 bytes a row,
    swizzled as wgmma reads it): one allocation, or with ``SLICE_BUFFERS`` one per slice. Triton cannot tell the
    slices of one allocation apart, so it puts a barrier between the eight stores of a tile (9 barriers per K tile in
    the loop against 2 with one allocation per slice, sm_90 code)."""
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * KW, element_bitwidth=16, rank=2)
    if SLICE_BUFFERS:
        bufs = ()
        for j in gl.static_range(8):
            bufs = bufs + (gl.allocate_shared_memory(gl.float16, [2, BLOCK_T, KW], layout),)
    else:
        bufs = (gl.allocate_shared_memory(gl.float16, [16, BLOCK_T, KW], layout),)
    return bufs


@gluon.jit
def gate_up_kernel(
    a_ptr,  # x codes: uint8 [M, H/2]
    as_ptr,  # x block scales: uint8 [M, H/16]
    ag_ptr,  # x row scales: fp32 [M]
    w_ptr,  # W_gate_up codes: uint8 [E, 2I, H/2]
    ws_ptr,  # uint8 [E, 2I, H/16]
    wg_ptr,  # fp32 [E]
    h_ptr,  # out: SiLU(gate) * up, fp32 [P, I] by sorted position (padding rows of a segment 0)
    sorted_ptr,  # [P] int32 slot ids (token * top_k + k), num_slots for padding
    expert_ptr,  # [P / BLOCK_T] int32 expert of each token block, -1 past the end
    num_slots,
    top_k,
    H: gl.constexpr,
    NI: gl.constexpr,
    BLOCK_T: gl.constexpr,
    BLOCK_N: gl.constexpr,  # gate (and as many up) rows per program: a multiple of 16 * NUM_WARPS
    BLOCK_K: gl.constexpr,  # 128 or 256
    NUM_WARPS: gl.constexpr,
    SLICE_BUFFERS: gl.constexpr,  # one shared-memory allocation per activation K-slice (`_x_smem`)
    GATE_FIRST: gl.constexpr,  # wait for gate's MMAs before decoding up's weights (fewer registers)
    PDL: gl.constexpr,
    # The hidden's quantization in this launch (`gluon_common.quantize_token_block`): the grid is then (column
    # tiles, token blocks), a block's tiles side by side, so that its last one is not in the launch's last wave.
    FUSED_HIDDEN: gl.constexpr = False,
    hq_ptr=None,  # with FUSED_HIDDEN, out: codes uint8 [P, I/2], scale bytes [P, I/16], row scales fp32 [P]
    hs_ptr=None,
    hg_ptr=None,
    cnt_ptr=None,  # int32 [P / BLOCK_T], zeros
):
    gdc_wait_for_producer(PDL)
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_T, 16]
    )
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    la1: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=1)
    pid_m = gl.program_id(1 if FUSED_HIDDEN else 0)
    pid_n = gl.program_id(0 if FUSED_HIDDEN else 1)
    e = gl.load(expert_ptr + pid_m)
    if e < 0:
        return
    KW: gl.constexpr = BLOCK_K // 8
    K_TILES: gl.constexpr = H // BLOCK_K
    # Activation tiles in registers: code words [T, KW] (a word pair, one NVFP4 block, per thread), scale bytes
    # [T, KW / 2] (one per thread).
    lw: gl.constexpr = gl.BlockedLayout([1, 2], [32 // (KW // 2), KW // 2], [NUM_WARPS, 1], [1, 0])
    ls: gl.constexpr = gl.BlockedLayout([1, 1], [32 // (KW // 2), KW // 2], [NUM_WARPS, 1], [1, 0])
    # The token rows of the block (padding reads row 0; its columns are dropped in the epilogue).
    _, slot, valid = token_block(sorted_ptr, pid_m, num_slots, BLOCK_T, gl.SliceLayout(1, lw))
    tok = gl.where(valid, slot // top_k, 0).to(gl.int64)[:, None]
    _, slot1, valid1 = token_block(sorted_ptr, pid_m, num_slots, BLOCK_T, gl.SliceLayout(1, ls))
    tok1 = gl.where(valid1, slot1 // top_k, 0).to(gl.int64)[:, None]
    x_w = a_ptr.to(gl.pointer_type(gl.uint32), bitcast=True)
    xw_off = tok * (H // 8) + gl.arange(0, KW, layout=gl.SliceLayout(0, lw)).to(gl.int64)[None, :]
    xs_off = tok1 * (H // 16) + gl.arange(0, KW // 2, layout=gl.SliceLayout(0, ls)).to(gl.int64)[None, :]
    g_off, gs_off = _w_offsets(e.to(gl.int64) * (2 * NI) + pid_n * BLOCK_N, H // 8, BLOCK_N, KW, la, la1)
    w_w = w_ptr.to(gl.pointer_type(gl.uint32), bitcast=True)
    u_off = NI * (H // 8)
    us_off = NI * (H // 16)
    buf = _x_smem(BLOCK_T, KW, SLICE_BUFFERS)
    xw, xs = _x_load(x_w, as_ptr, xw_off, xs_off, 0, KW)
    g, gs = gl.load(w_w + g_off), gl.load(ws_ptr + gs_off)
    u, us = gl.load(w_w + (g_off + u_off)), gl.load(ws_ptr + (gs_off + us_off))
    _x_store(buf, 0, xw, xs, lw, SLICE_BUFFERS)
    fence_async_shared()
    cta_barrier()
    acc_g = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, layout=mma)
    acc_u = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, layout=mma)
    for kt in range(K_TILES - 1):
        cur = (kt % 2) * 8
        if GATE_FIRST:
            # Gate's MMAs are waited for before up's weights are decoded: one decoded tile live, not two.
            gd = decode8(g, pair_scales(gs, la))
            xw, xs = _x_load(x_w, as_ptr, xw_off, xs_off, kt + 1, KW)
            g, gs = gl.load(w_w + (g_off + (kt + 1) * KW)), gl.load(ws_ptr + (gs_off + (kt + 1) * (KW // 2)))
            acc_g = _mma_tile(gd, buf, cur, acc_g, SLICE_BUFFERS)
            acc_g = warpgroup_mma_wait(0, deps=(acc_g,) + gd)[0]
            ud = decode8(u, pair_scales(us, la))
            u = gl.load(w_w + (g_off + (u_off + (kt + 1) * KW)))
            us = gl.load(ws_ptr + (gs_off + (us_off + (kt + 1) * (KW // 2))))
            acc_u = _mma_tile(ud, buf, cur, acc_u, SLICE_BUFFERS)
            _x_store(buf, 8 - cur, xw, xs, lw, SLICE_BUFFERS)
            fence_async_shared()
            acc_u = warpgroup_mma_wait(0, deps=(acc_u,) + ud)[0]
        else:
            gd = decode8(g, pair_scales(gs, la))
            ud = decode8(u, pair_scales(us, la))
            # The next tile's loads go out before this tile's MMAs.
            xw, xs = _x_load(x_w, as_ptr, xw_off, xs_off, kt + 1, KW)
            g, gs = gl.load(w_w + (g_off + (kt + 1) * KW)), gl.load(ws_ptr + (gs_off + (kt + 1) * (KW // 2)))
            u = gl.load(w_w + (g_off + (u_off + (kt + 1) * KW)))
            us = gl.load(ws_ptr + (gs_off + (us_off + (kt + 1) * (KW // 2))))
            acc_g = _mma_tile(gd, buf, cur, acc_g, SLICE_BUFFERS)
            acc_u = _mma_tile(ud, buf, cur, acc_u, SLICE_BUFFERS)
            # While they run, the next activation tile goes into the other buffer (free: the last tile's MMAs of
            # every warp were waited for before the barrier that ended it).
            _x_store(buf, 8 - cur, xw, xs, lw, SLICE_BUFFERS)
            fence_async_shared()
            acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u) + gd + ud)[:2]
        cta_barrier()
    cur = ((K_TILES - 1) % 2) * 8
    gd = decode8(g, pair_scales(gs, la))
    ud = decode8(u, pair_scales(us, la))
    acc_g = _mma_tile(gd, buf, cur, acc_g, SLICE_BUFFERS)
    acc_u = _mma_tile(ud, buf, cur, acc_u, SLICE_BUFFERS)
    acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u) + gd + ud)[:2]
    # Epilogue in a store-friendly layout (`silu_mul_store`).
    out_l: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [NUM_WARPS // 2, 2], [0, 1])
    acc_g = gl.convert_layout(acc_g, out_l)
    acc_u = gl.convert_layout(acc_u, out_l)
    offs_p, slot, valid = token_block(sorted_ptr, pid_m, num_slots, BLOCK_T, gl.SliceLayout(0, out_l))
    n_o = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_l))
    silu_mul_store(acc_g, acc_u, h_ptr, ag_ptr, wg_ptr, e, offs_p, slot, valid, n_o, top_k, NI)
    if FUSED_HIDDEN:
        quantize_token_block(h_ptr, hq_ptr, hs_ptr, hg_ptr, cnt_ptr, sorted_ptr, num_slots, pid_m, NI // BLOCK_N,
                             BLOCK_T, NI, NUM_WARPS)  # fmt: skip


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
    H: gl.constexpr,
    NI: gl.constexpr,
    BLOCK_T: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    NUM_WARPS: gl.constexpr,
    SLICE_BUFFERS: gl.constexpr,  # one shared-memory allocation per activation K-slice (`_x_smem`)
    PDL: gl.constexpr,
):
    gdc_wait_for_producer(PDL)
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_T, 16]
    )
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    la1: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=1)
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    e = gl.load(expert_ptr + pid_m)
    if e < 0:
        return
    KW: gl.constexpr = BLOCK_K // 8
    K_TILES: gl.constexpr = NI // BLOCK_K
    # Activation tiles in registers: code words [T, KW] (a word pair, one NVFP4 block, per thread), scale bytes
    # [T, KW / 2] (one per thread).
    lw: gl.constexpr = gl.BlockedLayout([1, 2], [32 // (KW // 2), KW // 2], [NUM_WARPS, 1], [1, 0])
    ls: gl.constexpr = gl.BlockedLayout([1, 1], [32 // (KW // 2), KW // 2], [NUM_WARPS, 1], [1, 0])
    p0 = pid_m.to(gl.int64) * BLOCK_T
    p = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, lw)).to(gl.int64)[:, None]
    p1 = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, ls)).to(gl.int64)[:, None]
    x_w = a_ptr.to(gl.pointer_type(gl.uint32), bitcast=True)
    xw_off = (p0 + p) * (NI // 8) + gl.arange(0, KW, layout=gl.SliceLayout(0, lw)).to(gl.int64)[None, :]
    xs_off = (p0 + p1) * (NI // 16) + gl.arange(0, KW // 2, layout=gl.SliceLayout(0, ls)).to(gl.int64)[None, :]
    w_off, s_off = _w_offsets(e.to(gl.int64) * H + pid_n * BLOCK_N, NI // 8, BLOCK_N, KW, la, la1)
    w_w = w_ptr.to(gl.pointer_type(gl.uint32), bitcast=True)
    buf = _x_smem(BLOCK_T, KW, SLICE_BUFFERS)
    xw, xs = _x_load(x_w, as_ptr, xw_off, xs_off, 0, KW)
    w, ws = gl.load(w_w + w_off), gl.load(ws_ptr + s_off)
    _x_store(buf, 0, xw, xs, lw, SLICE_BUFFERS)
    fence_async_shared()
    cta_barrier()
    acc = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, layout=mma)
    for kt in range(K_TILES - 1):
        cur = (kt % 2) * 8
        wd = decode8(w, pair_scales(ws, la))
        xw, xs = _x_load(x_w, as_ptr, xw_off, xs_off, kt + 1, KW)
        w, ws = gl.load(w_w + (w_off + (kt + 1) * KW)), gl.load(ws_ptr + (s_off + (kt + 1) * (KW // 2)))
        acc = _mma_tile(wd, buf, cur, acc, SLICE_BUFFERS)
        _x_store(buf, 8 - cur, xw, xs, lw, SLICE_BUFFERS)
        fence_async_shared()
        acc = warpgroup_mma_wait(0, deps=(acc,) + wd)[0]
        cta_barrier()
    cur = ((K_TILES - 1) % 2) * 8
    wd = decode8(w, pair_scales(ws, la))
    acc = _mma_tile(wd, buf, cur, acc, SLICE_BUFFERS)
    acc = warpgroup_mma_wait(0, deps=(acc,) + wd)[0]
    out_l: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [NUM_WARPS // 2, 2], [0, 1])
    acc = gl.convert_layout(acc, out_l)
    offs_p, slot, valid = token_block(sorted_ptr, pid_m, num_slots, BLOCK_T, gl.SliceLayout(0, out_l))
    down_store(acc, y_ptr, ag_ptr, tw_ptr, wg_ptr, e, offs_p, slot, valid, pid_n, 0, H, BLOCK_N, 1, out_l)


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------


def experts(cfg, xq, topk_ids, topk_weights, w_gate_up, w_down, align_backend, return_hidden):
    """`fp4_moe.experts_from_quantized` through these kernels with the `WGMMA` entry ``cfg`` (W4A4, sm_90+, many
    tokens per expert): same steps, same outputs as the decode kernels of `fp4_moe_hopper`. ``xq``, ``w_gate_up``,
    ``w_down``: NVFP4 `FP4Tensor`."""
    x, xs, xg, _ = fp4_args(xq)
    wgu, wgus, wgug, _ = fp4_args(w_gate_up)
    wd, wds, wdg, _ = fp4_args(w_down)
    E, H, NI = w_gate_up.shape[0], w_gate_up.shape[2], w_gate_up.shape[1] // 2
    M, K = topk_ids.shape
    sorted_ids, expert_ids = moe_align(topk_ids, E, cfg["block_t"], align_backend)
    n, bt, nw, bk = M * K, cfg["block_t"], cfg["num_warps"], cfg["block_k"]
    slices = bool(cfg.get("slice_buffers", False))
    cap = gate_up_cap(cfg, n, E, NI, x.device)
    regs, regs_down = ({"maxnreg": c} if c else {} for c in (cap, cfg.get("maxnreg_down") or cap))
    P = sorted_ids.numel()
    h = gate_up_out(1, P, NI, x.device)
    fused, grid = fused_hidden(cfg, return_hidden, P, NI, bt, cfg["block_n_gate_up"], x.device)
    gate_up_kernel[grid](
        x, xs, xg, wgu, wgus, wgug, h, sorted_ids, expert_ids, n, K, H, NI,
        BLOCK_T=bt, BLOCK_N=cfg["block_n_gate_up"], BLOCK_K=bk, NUM_WARPS=nw, SLICE_BUFFERS=slices,
        GATE_FIRST=bool(cfg.get("gate_first", False)), num_warps=nw, enable_fp_fusion=True,
        **fused, **regs, **launch_options(x.device),
    )  # fmt: skip
    if fused:
        hq, hidden = FP4Tensor(fused["hq_ptr"], fused["hs_ptr"], fused["hg_ptr"], "nvfp4"), None
    else:
        hq, hidden = down_input(h, xg, wgug, sorted_ids, expert_ids, n, K, bt, True, True, True, return_hidden)
    y = torch.empty(M, K, H, dtype=torch.float32, device=x.device)
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    down_kernel[(P // bt, H // cfg["block_n_down"])](
        hq.packed, hq.block_scale, hq.global_scale.reshape(-1), wd, wds, wdg, tw, y, sorted_ids, expert_ids, n, H, NI,
        BLOCK_T=bt, BLOCK_N=cfg["block_n_down"], BLOCK_K=bk, NUM_WARPS=nw, SLICE_BUFFERS=slices,
        num_warps=nw, enable_fp_fusion=True, **regs_down, **launch_options(x.device),
    )  # fmt: skip
    return y, hidden
