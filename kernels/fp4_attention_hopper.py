# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""FP4-KV decode attention on Hopper, in Gluon: packed K and V codes go from global memory straight into the
tensor-core operand registers, with no layout shuffle (the same idea as `fp4_moe_hopper`).

One program (one warp) takes one (sequence, KV head, split) of `fp4_attention.decode_attention`, with the query heads
of the KV group as the 8-wide N side of ``mma.m16n8k16`` in both products ("swap AB"):

* **Scores:** ``S^T = K Q^T``. K's tokens are the MMA's M rows. A thread holds pairs of consecutive K-columns per
  register, so K's codes are read as ``uint32`` words (8 elements each) in exactly that operand layout: a register
  pair is words ``w, w+1`` of one token. `gluon_common.decode8` turns nibble ``j`` of both into the fp16 operand register of
  K-slice ``j``, so slice ``j`` multiplies the elements ``8w + j``; Q is loaded in the same permuted order.
* **Output:** ``O^T = V^T P^T``. Here the K side of the MMA is the tokens, and a register holds two consecutive
  tokens of one row of ``V^T``: words ``w`` of tokens ``t, t+1``, read with one 4-byte load each. The same decoding
  gives slice ``j`` = column ``8w + j`` of V, so the output comes out as 8 accumulators, one per slice.
* **Scales** ride along: a register's two words lie in one NVFP4 block (K) or their two bytes are converted as a pair
  (V), by one ``cvt.rn.f16x2.e4m3x2``. The per-token row scales go on the fp32 scores (K) and on the probabilities
  (V).

* **Tiles in flight without registers:** with ``STAGES`` > 0 the next ``STAGES - 1`` tiles (codes, scale bytes, row
  scales) are copied into a ring in shared memory by ``cp.async`` while the current one is computed, then read from
  there into the operand layouts above. A second tile held in registers (``PREFETCH``, ``STAGES`` 0) cost 80
  registers and a third of the warps an SM can hold; the ring keeps 12 warps per SM and more bytes in flight (69%
  of copy bandwidth at batch 64 and 32K against 59%, docs/lab-notes.md 2e).

Numerics as `fp4_attention._attn_split_ptx`: exact fp16 operands ``E2M1 * s * 2^-14``, Q normalized per head by its
largest magnitude and the probabilities times V's row scales by their largest value in the tile (so that the terms
that matter keep fp16's 11 bits), fp32 accumulation and online softmax. GPU only (inline PTX; Gluon does not run in
the interpreter); `fp4_attention.decode_attention` picks it on sm_90+ for an FP4 cache with a head size that is a
multiple of 128.
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError(
        "Import trace_hf.kernels.fp4_attention_hopper (see kernels/README.md), not kernels.fp4_attention_hopper."
    )

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: E402

from trace_hf.kernels.gluon_common import (  # noqa: E402
    async_load,
    cta_barrier,
    decode8,
    gdc_wait_for_producer,
    pair_scales,
)


@gluon.jit
def _load_tile(k_words, ks_ptr, kg_ptr, v_words, vs_ptr, vg_ptr, row, n, k_off, t_k, ks_off, t_ks, v_off, vs_off, t_v,
               t_s, la: gl.constexpr, D: gl.constexpr, BLOCK_T: gl.constexpr):  # fmt: skip
    """The K and V codes, scale bytes and row scales of cache rows ``row ..`` (``n`` of them valid, the rest read as
    zeros), in `attn_split_kernel`'s operand layouts."""
    DW: gl.constexpr = D // 8
    kw = gl.load(k_words + row * DW + k_off, mask=(t_k < n)[:, None], other=0)
    ks = gl.load(ks_ptr + row * (D // 16) + ks_off, mask=(t_ks < n)[:, None], other=0)
    ks = pair_scales(ks, la)
    ok_v = (t_v < n)[None, None, :]
    vw = gl.load(v_words + row * DW + v_off, mask=ok_v[:, :, :, None], other=0)
    vw = gl.convert_layout(gl.reshape(gl.permute(vw, [0, 3, 1, 2]), [DW, BLOCK_T]), la)
    vs = gl.load(vs_ptr + row * (D // 16) + vs_off, mask=ok_v, other=0)
    vs = gl.convert_layout(gl.reshape(gl.permute(gl.join(vs, vs), [0, 3, 1, 2]), [DW, BLOCK_T]), la)
    kg = gl.load(kg_ptr + row + t_s.to(gl.int64), mask=t_s < n, other=0.0)
    vg = gl.load(vg_ptr + row + t_s.to(gl.int64), mask=t_s < n, other=0.0)
    return kw, ks, vw, vs, kg, vg


@gluon.jit
def _copy_tile(bufs, slot, k_words, ks_ptr, kg_ptr, v_words, vs_ptr, vg_ptr, row, n, c_off, t_c, cs_off, t_cs, cg_off,
               D: gl.constexpr):  # fmt: skip
    """cp.async of cache rows ``row ..`` (``n`` valid, the rest zero-filled) into ring slot ``slot``: K and V codes,
    scale bytes and row scales, each a contiguous run of the cache, copied in pieces of 16 (codes), 8 (scale bytes)
    and 4 bytes."""
    kwb, ksb, kgb, vwb, vsb, vgb = bufs
    ok = (t_c < n)[:, None]
    async_load(kwb.index(slot), k_words + (row * (D // 8) + c_off), mask=ok)
    async_load(vwb.index(slot), v_words + (row * (D // 8) + c_off), mask=ok)
    ok_s = (t_cs < n)[:, None]
    async_load(ksb.index(slot), ks_ptr + (row * (D // 16) + cs_off), mask=ok_s)
    async_load(vsb.index(slot), vs_ptr + (row * (D // 16) + cs_off), mask=ok_s)
    async_load(kgb.index(slot), kg_ptr + (row + cg_off), mask=cg_off < n)
    async_load(vgb.index(slot), vg_ptr + (row + cg_off), mask=cg_off < n)
    cp.commit_group()


@gluon.jit
def _read_tile(bufs, slot, la: gl.constexpr, l1: gl.constexpr, lv: gl.constexpr, ls: gl.constexpr,
               D: gl.constexpr, BLOCK_T: gl.constexpr):  # fmt: skip
    """The tile in ring slot ``slot``, in `_load_tile`'s register layouts (V through a [DW/16, 8, BLOCK_T, 2] view
    of its [BLOCK_T, DW] buffer, as `_load_tile` reads it from global memory)."""
    DW: gl.constexpr = D // 8
    kwb, ksb, kgb, vwb, vsb, vgb = bufs
    kw = kwb.index(slot).load(la)
    ks = pair_scales(ksb.index(slot).load(l1), la)
    vw = vwb.index(slot).reshape([BLOCK_T, DW // 16, 8, 2]).permute([1, 2, 0, 3]).load(lv)
    vw = gl.convert_layout(gl.reshape(gl.permute(vw, [0, 3, 1, 2]), [DW, BLOCK_T]), la)
    vs = vsb.index(slot).reshape([BLOCK_T, DW // 16, 8]).permute([1, 2, 0]).load(gl.SliceLayout(3, lv))
    vs = gl.convert_layout(gl.reshape(gl.permute(gl.join(vs, vs), [0, 3, 1, 2]), [DW, BLOCK_T]), la)
    kg = kgb.index(slot).load(ls)
    vg = vgb.index(slot).load(ls)
    return kw, ks, vw, vs, kg, vg


@gluon.jit
def attn_split_kernel(
    q_ptr,  # [B, HQ, D] post-RoPE queries
    k_ptr,  # K codes: uint8 [B, HKV, T, D/2]
    ks_ptr,  # uint8 [B, HKV, T, D/16]
    kg_ptr,  # fp32 [B, HKV, T]
    v_ptr,
    vs_ptr,
    vg_ptr,
    len_ptr,  # [B] int: tokens in the cache (the new one included)
    o_ptr,  # out: [B, HQ, S, D] fp32 partial outputs
    lse_ptr,  # out: [B, HQ, S] fp32 log-sum-exp of each split (-inf if empty)
    sm_scale,
    T,
    chunk,
    HQ: gl.constexpr,
    HKV: gl.constexpr,
    S: gl.constexpr,
    D: gl.constexpr,
    GROUP: gl.constexpr,
    G_PAD: gl.constexpr,
    BLOCK_T: gl.constexpr,
    PREFETCH: gl.constexpr,
    STAGES: gl.constexpr,
    PDL: gl.constexpr,
):
    gdc_wait_for_producer(PDL)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    DW: gl.constexpr = D // 8  # uint32 code words per row
    b = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    seqlen = gl.load(len_ptr + b)
    start = split * chunk
    end = gl.minimum(start + chunk, seqlen)
    base = (b * HKV + kvh).to(gl.int64) * T

    # Q^T in the order of K's slices: slice j holds q[g, 8w + j], scaled by sm_scale / (largest |q| of head g).
    g_b = gl.arange(0, G_PAD, layout=gl.SliceLayout(0, lb))
    w_b = gl.arange(0, DW, layout=gl.SliceLayout(1, lb))
    q_ptrs = q_ptr + (b * HQ + kvh * GROUP + g_b).to(gl.int64)[None, :] * D + (8 * w_b)[:, None]
    q_ok = (g_b < GROUP)[None, :]
    q = (
        gl.load(q_ptrs + 0, mask=q_ok, other=0.0).to(gl.float32) * sm_scale,
        gl.load(q_ptrs + 1, mask=q_ok, other=0.0).to(gl.float32) * sm_scale,
        gl.load(q_ptrs + 2, mask=q_ok, other=0.0).to(gl.float32) * sm_scale,
        gl.load(q_ptrs + 3, mask=q_ok, other=0.0).to(gl.float32) * sm_scale,
        gl.load(q_ptrs + 4, mask=q_ok, other=0.0).to(gl.float32) * sm_scale,
        gl.load(q_ptrs + 5, mask=q_ok, other=0.0).to(gl.float32) * sm_scale,
        gl.load(q_ptrs + 6, mask=q_ok, other=0.0).to(gl.float32) * sm_scale,
        gl.load(q_ptrs + 7, mask=q_ok, other=0.0).to(gl.float32) * sm_scale,
    )
    q_max = gl.max(gl.abs(q[0]), axis=0)
    for j in gl.static_range(1, 8):
        q_max = gl.maximum(q_max, gl.max(gl.abs(q[j]), axis=0))
    q_max = gl.where(q_max > 0, q_max, 1.0)
    qh = (
        (q[0] / q_max[None, :]).to(gl.float16),
        (q[1] / q_max[None, :]).to(gl.float16),
        (q[2] / q_max[None, :]).to(gl.float16),
        (q[3] / q_max[None, :]).to(gl.float16),
        (q[4] / q_max[None, :]).to(gl.float16),
        (q[5] / q_max[None, :]).to(gl.float16),
        (q[6] / q_max[None, :]).to(gl.float16),
        (q[7] / q_max[None, :]).to(gl.float16),
    )
    q_max = gl.convert_layout(q_max, gl.SliceLayout(0, mma)) * 16384.0  # 2^14 undoes K's decoding factor

    # K tile [BLOCK_T, DW] (tokens x words): registers hold words w, w+1 of a token, one 8-byte load.
    t_k = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, la))
    w_k = gl.arange(0, DW, layout=gl.SliceLayout(0, la))
    k_off = t_k.to(gl.int64)[:, None] * DW + w_k.to(gl.int64)[None, :]  # int64: immediate offsets per register
    # K's scale bytes, one per register pair (words w, w+1 share a block): loaded in the k_width=1 operand layout
    # (a thread holds blocks q, q + 4, ...) and doubled in registers by join + reshape, which gives the k_width=2 one.
    l1: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=1)
    t_ks = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, l1))
    ks_off = t_ks.to(gl.int64)[:, None] * (D // 16) + gl.arange(0, D // 16, layout=gl.SliceLayout(0, l1))[None, :]
    # V^T tile [DW, BLOCK_T] (words x tokens): registers hold a word of tokens t, t+1. Row m = 16i + 8r + g of the
    # operand (i: M tile, r: upper half, g: lane // 4) is word 16i + 2g + r, so that a thread's two rows of a tile
    # are adjacent words of one block: one 8-byte load and one scale byte per token for both. Loaded as
    # [DW/16, 8, BLOCK_T, 2] (i, g, t, r), then put in operand order.
    lv: gl.constexpr = gl.BlockedLayout([1, 1, 2, 2], [1, 8, 4, 1], [1, 1, 1, 1], [3, 2, 1, 0])
    i_v = gl.arange(0, DW // 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, lv))))
    g_v = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, lv))))
    t_v = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, lv))))
    r_v = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, lv))))
    blk_v = (8 * i_v[:, None] + g_v[None, :]).to(gl.int64)[:, :, None]  # [DW/16, 8, 1]: the block of both words
    vs_off = t_v.to(gl.int64)[None, None, :] * (D // 16) + blk_v
    v_off = (t_v.to(gl.int64)[None, None, :] * DW + 2 * blk_v)[:, :, :, None] + r_v[None, None, None, :]
    t_s = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, mma))
    k_words = k_ptr.to(gl.pointer_type(gl.uint32), bitcast=True)
    v_words = v_ptr.to(gl.pointer_type(gl.uint32), bitcast=True)

    m_i = gl.full([G_PAD], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
    l_i = gl.zeros([G_PAD], gl.float32, layout=gl.SliceLayout(0, mma))
    zero = gl.zeros([DW, G_PAD], gl.float32, layout=mma)
    acc = (zero, zero, zero, zero, zero, zero, zero, zero)
    # PREFETCH: software pipelining by hand (Gluon does not pipeline), the next tile's loads go out before this
    # tile's math; it costs the registers of a second tile (fewer warps per SM).
    args = (k_words, ks_ptr, kg_ptr, v_words, vs_ptr, vg_ptr)
    offs = (k_off, t_k, ks_off, t_ks, v_off, vs_off, t_v, t_s)
    if STAGES > 0:
        # The cp.async ring: STAGES tiles in shared memory, STAGES - 1 of them in flight while one is computed.
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        flat1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        bufs = (
            gl.allocate_shared_memory(gl.uint32, [STAGES, BLOCK_T, DW], flat),
            gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_T, D // 16], flat),
            gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_T], flat1),
            gl.allocate_shared_memory(gl.uint32, [STAGES, BLOCK_T, DW], flat),
            gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_T, D // 16], flat),
            gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_T], flat1),
        )
        lc: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [1, 1], [1, 0])  # 16-byte pieces of the code rows
        t_c = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, lc))
        c_off = t_c.to(gl.int64)[:, None] * DW + gl.arange(0, DW, layout=gl.SliceLayout(0, lc)).to(gl.int64)[None, :]
        SB: gl.constexpr = D // 16  # scale bytes per row, copied 8 at a time
        lcs: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (SB // 8), SB // 8], [1, 1], [1, 0])
        t_cs = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, lcs))
        cs_off = (
            t_cs.to(gl.int64)[:, None] * SB + gl.arange(0, SB, layout=gl.SliceLayout(0, lcs)).to(gl.int64)[None, :]
        )
        lcg: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        cg_off = gl.arange(0, BLOCK_T, layout=lcg)
        cargs = (k_words, ks_ptr, kg_ptr, v_words, vs_ptr, vg_ptr)
        coffs = (c_off, t_c, cs_off, t_cs, cg_off)
        for st in gl.static_range(STAGES - 1):
            _copy_tile(bufs, st, *cargs, base + start + st * BLOCK_T, end - start - st * BLOCK_T, *coffs, D)
    elif PREFETCH:
        tile = _load_tile(*args, base + start, end - start, *offs, la, D, BLOCK_T)
    for t0 in range(start, end, BLOCK_T):
        n = end - t0  # valid tokens from t0 on
        if STAGES > 0:
            it = (t0 - start) // BLOCK_T
            cta_barrier()  # every lane is done reading the slot the next copy overwrites
            ahead = (STAGES - 1) * BLOCK_T
            _copy_tile(bufs, (it + STAGES - 1) % STAGES, *cargs, base + t0 + ahead, n - ahead, *coffs, D)
            cp.wait_group(STAGES - 1)
            cta_barrier()  # the copies of tile `it`, by every lane, have landed
            kw, ks, vw, vs, kg, vg = _read_tile(bufs, it % STAGES, la, l1, lv, gl.SliceLayout(1, mma), D, BLOCK_T)
        elif PREFETCH:
            nxt = _load_tile(*args, base + t0 + BLOCK_T, n - BLOCK_T, *offs, la, D, BLOCK_T)
            kw, ks, vw, vs, kg, vg = tile
        else:
            kw, ks, vw, vs, kg, vg = _load_tile(*args, base + t0, n, *offs, la, D, BLOCK_T)
        ok_s = t_s < n
        k = decode8(kw, ks)
        s = gl.zeros([BLOCK_T, G_PAD], gl.float32, layout=mma)
        for j in gl.static_range(8):
            s = mma_v2(k[j], qh[j], s)
        s = s * kg[:, None] * q_max[None, :]
        s = gl.where(ok_s[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp(m_i - m_new)
        p = gl.exp(s - m_new[None, :])
        l_i = l_i * alpha + gl.sum(p, axis=0)
        pw = p * vg[:, None]
        pw_max = gl.max(pw, axis=0)
        pw_max = gl.where(pw_max > 0, pw_max, 1.0)
        ph = gl.convert_layout((pw / pw_max[None, :]).to(gl.float16), lb)
        c = (pw_max * 16384.0)[None, :]

        v = decode8(vw, vs)
        acc = (
            acc[0] * alpha[None, :] + mma_v2(v[0], ph, zero) * c,
            acc[1] * alpha[None, :] + mma_v2(v[1], ph, zero) * c,
            acc[2] * alpha[None, :] + mma_v2(v[2], ph, zero) * c,
            acc[3] * alpha[None, :] + mma_v2(v[3], ph, zero) * c,
            acc[4] * alpha[None, :] + mma_v2(v[4], ph, zero) * c,
            acc[5] * alpha[None, :] + mma_v2(v[5], ph, zero) * c,
            acc[6] * alpha[None, :] + mma_v2(v[6], ph, zero) * c,
            acc[7] * alpha[None, :] + mma_v2(v[7], ph, zero) * c,
        )
        m_i = m_new
        if STAGES == 0 and PREFETCH:
            tile = nxt

    empty = l_i == 0.0
    lse = gl.where(empty, float("-inf"), m_i + gl.log(gl.where(empty, 1.0, l_i)))
    inv_l = (1.0 / gl.where(empty, 1.0, l_i))[None, :]
    g_o = gl.arange(0, G_PAD, layout=gl.SliceLayout(0, mma))
    m_o = gl.arange(0, DW, layout=gl.SliceLayout(1, mma))
    w_o = (m_o // 16) * 16 + 2 * (m_o % 8) + (m_o // 8) % 2  # the word of V^T's row m (see the loads)
    out = (b * HQ + kvh * GROUP + g_o).to(gl.int64) * S + split
    o_ptrs = o_ptr + out[None, :] * D + (8 * w_o)[:, None]
    o_ok = (g_o < GROUP)[None, :]
    for j in gl.static_range(8):
        gl.store(o_ptrs + j, acc[j] * inv_l, mask=o_ok)
    gl.store(lse_ptr + out, lse, mask=g_o < GROUP)
