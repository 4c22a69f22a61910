# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""FP4 KV cache for decode: the cache write and a split-K decode attention that reads packed FP4 K/V.

Layout (static, preallocated, so that a CUDA graph can capture the decode step): per layer
``K/V codes [B, Hkv, Tmax, D/2]`` uint8, ``block scales [B, Hkv, Tmax, D/16]`` uint8 (E4M3), ``row scales
[B, Hkv, Tmax]`` fp32. A token's K (and V) of one head is quantized exactly as ``fp4.quantize(k, "nvfp4",
"row")`` (what `trace_hf.quant.kv_cache.FP4KVLayer` stores and the training side fake-quantizes), bit for bit.

`qkv_post` is the write: it takes the fused QKV projection of the decode tokens, applies Qwen3's per-head
q/k RMSNorm and RoPE, writes the post-RoPE Q (for the attention) and stores K and V in the cache at each
sequence's position, in one launch. `decode_attention` is flash-decoding: the sequence is cut into splits, each
program handles one (sequence, KV head, split) with all the query heads of its GQA group as the rows of one
``tl.dot``, decodes K and V in registers (``E2M1 * s`` exact, the per-token row scale applied to the scores and
to the probabilities; on the GPU by inline PTX into fp16, `_attn_split_ptx`), and `_combine_kernel` merges the
splits by their log-sum-exp. The same kernels take a BF16 cache (``KV_FP4=False``): the BF16 baseline.
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.fp4_attention (see kernels/README.md), not kernels.fp4_attention.")

import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trace_hf import fp4  # noqa: E402
from trace_hf.kernels.common import (  # noqa: E402
    DOT_BF16,
    INTERPRETED,
    check_device,
    e2m1_nearest,
    gluon_module,
    hardware_fp8,
    is_finite,
    load_fp4_rows,
    load_halves,
    nvfp4_block_scale,
)
from trace_hf.kernels.pdl import launch_options, wait_for_producer  # noqa: E402


# ----------------------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------------------


@dataclass
class KVCache:
    """One layer's static K/V cache. FP4: ``k``/``v`` codes [B, Hkv, T, D/2] uint8, ``k_scale``/``v_scale``
    [B, Hkv, T, D/16] uint8, ``k_g``/``v_g`` [B, Hkv, T] fp32. Dense: ``k``/``v`` [B, Hkv, T, D], scales None."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_g: torch.Tensor | None = None
    v_g: torch.Tensor | None = None

    @property
    def fp4(self) -> bool:
        return self.k_scale is not None

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3] * (2 if self.fp4 else 1)

    def nbytes(self) -> int:
        ts = [self.k, self.v, self.k_scale, self.v_scale, self.k_g, self.v_g]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale, self.k_g, self.v_g) if t is not None]


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, fp4: bool, dtype_bytes: int = 2) -> int:
    """Bytes one token adds to one layer's cache (K and V)."""
    per_row = head_dim // 2 + head_dim // 16 + 4 if fp4 else head_dim * dtype_bytes
    return 2 * num_kv_heads * per_row


def allocate_kv_cache(
    batch: int, num_kv_heads: int, max_len: int, head_dim: int, fp4: bool, dtype=torch.bfloat16, device="cuda"
) -> KVCache:
    shape = (batch, num_kv_heads, max_len)
    if not fp4:
        return KVCache(torch.zeros(*shape, head_dim, dtype=dtype, device=device),
                       torch.zeros(*shape, head_dim, dtype=dtype, device=device))  # fmt: skip
    u8 = {"dtype": torch.uint8, "device": device}
    return KVCache(
        torch.zeros(*shape, head_dim // 2, **u8), torch.zeros(*shape, head_dim // 2, **u8),
        torch.zeros(*shape, head_dim // 16, **u8), torch.zeros(*shape, head_dim // 16, **u8),
        torch.zeros(shape, dtype=torch.float32, device=device), torch.zeros(shape, dtype=torch.float32, device=device),
    )  # fmt: skip


def fill_random(cache: KVCache, generator: torch.Generator | None = None) -> None:
    """Random content (benchmarks: a decode step costs the same whatever the values are). FP4 scales get sane
    E4M3 bytes (no NaN encoding) and row scales around 1e-2."""
    if cache.fp4:
        for t in (cache.k, cache.v):
            t.random_(0, 256, generator=generator)
        for t in (cache.k_scale, cache.v_scale):
            t.random_(0x30, 0x48, generator=generator)
        for t in (cache.k_g, cache.v_g):
            t.uniform_(0.005, 0.02, generator=generator)
    else:
        for t in (cache.k, cache.v):
            t.normal_(generator=generator)


def fill_cache(cache: KVCache, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Put K and V [B, Hkv, T, D] in the cache as `qkv_post` stores them (FP4: ``fp4.quantize(x, "nvfp4", "row")``);
    returns the values the cache now holds (dequantized), what the attention must be compared against."""
    if not cache.fp4:
        cache.k.copy_(k)
        cache.v.copy_(v)
        return cache.k.clone(), cache.v.clone()
    held = []
    for x, codes, scales, g in ((k, cache.k, cache.k_scale, cache.k_g), (v, cache.v, cache.v_scale, cache.v_g)):
        q = fp4.quantize(x, "nvfp4", "row")
        codes.copy_(q.packed)
        scales.copy_(q.block_scale)
        g.copy_(q.global_scale[..., 0])
        held.append(q.dequantize())
    return held[0], held[1]


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_row_store(x, q_ptr, s_ptr, g_ptr, D: tl.constexpr):
    """Quantize one row ``x`` [D] (fp32) to NVFP4 with its own global scale, as `trace_hf.fp4.quantize` with
    ``scale="row"`` (the same bit logic as `trace_hf.kernels.fp4_quant`), and store codes, scale bytes and g."""
    NB: tl.constexpr = D // 16
    xb = tl.reshape(x, [NB, 16])
    sign = ((xb.to(tl.int32, bitcast=True) >> 28) & 8).to(tl.int32)
    fin = is_finite(xb)
    ax = tl.where(fin, tl.abs(xb), 0.0)
    amax_b = tl.max(ax, axis=1)  # [NB]
    bad_b = tl.max((~fin).to(tl.int32), axis=1) > 0
    amax_r = tl.max(amax_b, axis=0)
    bad_r = tl.max(bad_b.to(tl.int32), axis=0) > 0
    g = tl.div_rn(tl.where(bad_r, float("nan"), amax_r) + tl.zeros([NB], tl.float32), 2688.0)  # [NB], all equal
    sbyte, s, sg, ok = nvfp4_block_scale(amax_b, g)  # the one NVFP4 scale rule, shared with fp4_quant
    y = tl.div_rn(xb, tl.where(ok, sg, 1.0)[:, None])
    a = tl.minimum(tl.maximum(y, -6.0), 6.0)
    a = tl.where(ok[:, None] & fin, tl.abs(a), 0.0)
    code = tl.where(ok[:, None], e2m1_nearest(a), 0) | sign
    lo, hi = tl.split(tl.reshape(code, [D // 2, 2]))
    tl.store(q_ptr + tl.arange(0, D // 2), (lo | (hi << 4)).to(tl.uint8))
    tl.store(s_ptr + tl.arange(0, NB), sbyte.to(tl.uint8))
    tl.store(g_ptr + tl.arange(0, 1), tl.max(g, axis=0) + tl.zeros([1], tl.float32))


@triton.jit
def _norm_rope(x_ptr, w_ptr, cos_ptr, sin_ptr, pos, eps, D: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
               R: tl.constexpr, ROUND: tl.constexpr, dt: tl.constexpr):  # fmt: skip
    """One head's row: RMSNorm over D (q_norm / k_norm), then rotate-half RoPE at position ``pos`` on its first R
    dims (R < D: partial rotary, the rest passed on). ``ROUND``: round to ``dt`` where transformers' ops do (after
    the norm, each RoPE product and their sum; Qwen3.5), else all in fp32 (Qwen3)."""
    d = tl.arange(0, D)
    x = tl.load(x_ptr + d).to(tl.float32)
    if ROPE:
        pd = tl.where(d < R, (d + R // 2) % R, d)
        xp = tl.load(x_ptr + pd).to(tl.float32)
    if NORM:
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        x = (x * r) * tl.load(w_ptr + d).to(tl.float32)
        if ROPE:
            xp = (xp * r) * tl.load(w_ptr + pd).to(tl.float32)
        if ROUND:
            x = x.to(dt).to(tl.float32)
            if ROPE:
                xp = xp.to(dt).to(tl.float32)
    if ROPE:
        rot = d < R
        c = tl.load(cos_ptr + pos * R + d, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * R + d, mask=rot, other=0.0).to(tl.float32)
        xp = tl.where(d < R // 2, -xp, xp)
        if ROUND:
            y = ((x * c).to(dt).to(tl.float32) + (xp * s).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        else:
            y = x * c + xp * s
        x = tl.where(rot, y, x)
    return x


@triton.jit
def _qkv_post_kernel(
    qkv_ptr,  # [B, >= (HQ + 2 HKV) * D] fused projection output (q, k, v heads first)
    qkv_stride,
    qn_ptr,  # q_norm weight [D]
    kn_ptr,  # k_norm weight [D]
    cos_ptr,  # [Tpos, R]
    sin_ptr,
    pos_ptr,  # [B] int: position of the token = where it goes in the cache
    q_out_ptr,  # [B, HQ, D]
    k_ptr,  # cache: codes [B, HKV, T, D/2] (FP4) or dense [B, HKV, T, D]
    ks_ptr,
    kg_ptr,
    v_ptr,
    vs_ptr,
    vg_ptr,
    T,
    eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    NORM: tl.constexpr,
    ROPE: tl.constexpr,
    R: tl.constexpr,
    ROUND: tl.constexpr,
    KV_FP4: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producer(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    row = qkv_ptr + b.to(tl.int64) * qkv_stride
    d = tl.arange(0, D)
    dt = q_out_ptr.dtype.element_ty
    if h < HQ:
        q = _norm_rope(row + h * D, qn_ptr, cos_ptr, sin_ptr, pos, eps, D, NORM, ROPE, R, ROUND, dt)
        tl.store(q_out_ptr + (b * HQ + h).to(tl.int64) * D + d, q.to(dt))
    else:
        j = h - HQ
        k = _norm_rope(row + h * D, kn_ptr, cos_ptr, sin_ptr, pos, eps, D, NORM, ROPE, R, ROUND, dt)
        v = tl.load(row + (HQ + HKV + j) * D + d).to(tl.float32)
        t = (b * HKV + j).to(tl.int64) * T + pos  # cache row of this token and head
        if KV_FP4:
            _quantize_row_store(k, k_ptr + t * (D // 2), ks_ptr + t * (D // 16), kg_ptr + t, D)
            _quantize_row_store(v, v_ptr + t * (D // 2), vs_ptr + t * (D // 16), vg_ptr + t, D)
        else:
            tl.store(k_ptr + t * D + d, k.to(k_ptr.dtype.element_ty))
            tl.store(v_ptr + t * D + d, v.to(v_ptr.dtype.element_ty))


@triton.jit
def _attn_split_kernel(
    q_ptr,  # [B, HQ, D]
    k_ptr,
    ks_ptr,
    kg_ptr,
    v_ptr,
    vs_ptr,
    vg_ptr,
    len_ptr,  # [B] int: tokens in the cache (the new one included)
    o_ptr,  # [B, HQ, S, D] fp32 partial outputs
    lse_ptr,  # [B, HQ, S] fp32 log-sum-exp of each split (-inf if empty)
    sm_scale,
    T,
    chunk,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    S: tl.constexpr,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    KV_FP4: tl.constexpr,
    DOT_BF16: tl.constexpr,
    PTX: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producer(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seqlen = tl.load(len_ptr + b)
    start = split * chunk
    end = tl.minimum(start + chunk, seqlen)
    g = tl.arange(0, G_PAD)
    g_ok = g < GROUP
    qh = kvh * GROUP + g
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * HQ + qh).to(tl.int64)[:, None] * D + d[None, :], mask=g_ok[:, None], other=0.0)
    q = q.to(tl.float32) * sm_scale
    base = (b * HKV + kvh).to(tl.int64) * T
    if PTX:
        o, lse = _attn_split_ptx(q, k_ptr, ks_ptr, kg_ptr, v_ptr, vs_ptr, vg_ptr, start, end, base, G_PAD, D, BLOCK_T)
    else:
        o, lse = _attn_split(q, k_ptr, ks_ptr, kg_ptr, v_ptr, vs_ptr, vg_ptr, start, end, base, G_PAD, D, BLOCK_T,
                             KV_FP4, DOT_BF16)  # fmt: skip
    out = (b * HQ + qh).to(tl.int64) * S + split
    tl.store(o_ptr + out[:, None] * D + d[None, :], o, mask=g_ok[:, None])
    tl.store(lse_ptr + out, lse, mask=g_ok)


@triton.jit
def _attn_split(q, k_ptr, ks_ptr, kg_ptr, v_ptr, vs_ptr, vg_ptr, start, end, base, G_PAD: tl.constexpr,
                D: tl.constexpr, BLOCK_T: tl.constexpr, KV_FP4: tl.constexpr, DOT_BF16: tl.constexpr):  # fmt: skip
    """Online softmax over cache rows ``base + start .. base + end``: (output, log-sum-exp) of each query row."""
    d = tl.arange(0, D)
    if DOT_BF16:
        q = q.to(tl.bfloat16)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < end
        rows = base + t
        if KV_FP4:
            k = load_fp4_rows(k_ptr, ks_ptr, rows, t_ok, 0, D, BLOCK_T, D)
            v = load_fp4_rows(v_ptr, vs_ptr, rows, t_ok, 0, D, BLOCK_T, D)
        else:
            k = tl.load(k_ptr + rows[:, None] * D + d[None, :], mask=t_ok[:, None], other=0.0)
            v = tl.load(v_ptr + rows[:, None] * D + d[None, :], mask=t_ok[:, None], other=0.0)
        if DOT_BF16:
            s = tl.dot(q, tl.trans(k.to(tl.bfloat16)))
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        if KV_FP4:
            s = s * tl.load(kg_ptr + rows, mask=t_ok, other=0.0)[None, :]
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_FP4:
            p = p * tl.load(vg_ptr + rows, mask=t_ok, other=0.0)[None, :]
        if DOT_BF16:
            acc = tl.dot(p.to(tl.bfloat16), v.to(tl.bfloat16), acc * alpha[:, None])
        else:
            acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
        m_i = m_new
    empty = l_i == 0.0
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    return acc / tl.where(empty, 1.0, l_i)[:, None], lse


@triton.jit
def _attn_split_ptx(q, k_ptr, ks_ptr, kg_ptr, v_ptr, vs_ptr, vg_ptr, start, end, base, G_PAD: tl.constexpr,
                    D: tl.constexpr, BLOCK_T: tl.constexpr):  # fmt: skip
    """`_attn_split` for an FP4 cache on the GPU: K and V decoded by `fp4_halves_f16` (exact fp16, times
    2^-14) as even/odd column halves. The fp16 operands of the dots are normalized per query row, Q by its largest
    magnitude and the probabilities times V's row scales by their largest value in the tile, so that the terms
    that matter keep fp16's 11 bits whatever the scales (bf16 keeps 8); the factors go back on in fp32."""
    q_max = tl.max(tl.abs(q), axis=1)
    q_max = tl.where(q_max > 0, q_max, 1.0)
    q0, q1 = tl.split(tl.reshape((q / q_max[:, None]).to(tl.float16), [G_PAD, D // 2, 2]))
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc0 = tl.zeros([G_PAD, D // 2], tl.float32)
    acc1 = tl.zeros([G_PAD, D // 2], tl.float32)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < end
        rows = base + t
        k0, k1 = load_halves(k_ptr, ks_ptr, rows, t_ok, 0, D, True, D, True)
        s = tl.dot(q1, tl.trans(k1), tl.dot(q0, tl.trans(k0)))
        kg = tl.load(kg_ptr + rows, mask=t_ok, other=0.0) * 16384.0
        s = s * q_max[:, None] * kg[None, :]
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        w = p * tl.load(vg_ptr + rows, mask=t_ok, other=0.0)[None, :]
        w_max = tl.max(w, axis=1)
        w_max = tl.where(w_max > 0, w_max, 1.0)
        wh = (w / w_max[:, None]).to(tl.float16)
        v0, v1 = load_halves(v_ptr, vs_ptr, rows, t_ok, 0, D, True, D, True)
        c = (w_max * 16384.0)[:, None]
        acc0 = acc0 * alpha[:, None] + tl.dot(wh, v0) * c
        acc1 = acc1 * alpha[:, None] + tl.dot(wh, v1) * c
        m_i = m_new
    empty = l_i == 0.0
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    return tl.reshape(tl.join(acc0, acc1), [G_PAD, D]) / tl.where(empty, 1.0, l_i)[:, None], lse


@triton.jit
def _combine_kernel(o_ptr, lse_ptr, out_ptr, R, S: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr,
                    ROWS: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Merge the splits of ``ROWS`` (sequence, query head) rows by their log-sum-exp. Several rows per program: a
    4-warp program per row spent its time in the reductions of a few KB, not in moving them (docs/lab-notes.md
    2h)."""
    wait_for_producer(PDL)
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    r_ok = r < R
    sp = tl.arange(0, S_PAD)
    d = tl.arange(0, D)
    ok = r_ok[:, None] & (sp < S)[None, :]
    lse = tl.load(lse_ptr + r[:, None] * S + sp[None, :], mask=ok, other=float("-inf"))
    m = tl.max(lse, axis=1)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m[:, None]))
    o = tl.load(
        o_ptr + (r[:, None] * S + sp[None, :])[:, :, None] * D + d[None, None, :], mask=ok[:, :, None], other=0.0
    )
    out = tl.sum(w[:, :, None] * o, axis=1) / tl.sum(w, axis=1)[:, None]
    tl.store(out_ptr + r[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=r_ok[:, None])


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------

#: Launch configs by cache kind (``fp4``: the best of `benchmarks/kernels/fp4_attention_tune.py` on the H200,
#: docs/lab-notes.md; ``dense``: the BF16 baseline, at the copy bandwidth with it). Splits: enough programs for
#: ``target_programs``, chunks of at least ``min_chunk`` tokens, a multiple of every ``block_t``. ``ptx``: an FP4
#: cache is decoded by inline PTX into fp16 operands (`_attn_split_ptx`; the GPU only). ``hopper``: the Gluon kernel
#: of `fp4_attention_hopper` for an FP4 cache on sm_90+, with its own split rule (one warp per program, so it wants
#: more programs, but at most ``max_splits`` splits: the combine's cost grows with them); ``stages``: tiles in flight
#: in a cp.async ring in shared memory (0: none, loads straight to registers); ``prefetch`` (``stages`` 0 only): the
#: next tile's loads, into registers, before this tile's math; ``maxnreg``: a register cap (more warps per SM);
#: ``small_batch``: the tile and ring depth up to ``max_batch`` sequences (`hopper_config`); ``wide_heads``: the
#: settings for heads of ``min_head_dim`` or more (`hopper_config`; a 256-wide tile of codes per token holds twice
#: the registers). The kernel decodes by `gluon_common.nibbles_spread_ptx`, 3 integer instructions per fp16 pair
#: where the decoding before it took 4 (the same operand bits; sm_90 loop at the 64-token tile 1,823 against 2,073
#: instructions, 168 registers both, Triton 3.6): one call at 384 x 8K 678 -> 601 us, 64 x 32K 432 -> 384, 64 x 1K
#: 30.9 -> 29.7, 1 x 32K 21.3 -> 20.6, 1 x 1K 7.1 -> 6.6, the decode step at 384 x 8K +6%; 256-wide heads
#: (their 32-token tile: 1,941 -> 1,684 instructions, 229 registers against 220, no spills) faster per call at 384 x
#: 8K, 64 x 32K, 64 x 1K and 1 x 32K (docs/lab-notes.md 13). From `fp4_attention_tune.py --hopper` on the H200: 128-wide
#: heads docs/lab-notes.md 2d; ``wide_heads`` at Qwen3.5's 16 query / 2 KV heads of 256 (docs/lab-notes.md 7d: 2,639
#: against 4,008 us a layer at 384 x 32K, 66% of copy bandwidth; 32-token tiles won at 64, 96 and 384 rows). Empty: the
#: Triton kernel everywhere. ``round_splits_up``: the fewest splits that reach ``target_programs`` (rounded up), where
#: without it the most that stay under (rounded down). Rounding down left 96 and 192 rows with 768 programs of 128-wide
#: heads (2 and 1 splits); 1,024 rounded up gives them 1,152 and 1,536 and every batch of 20, 64, 128, 256 and 512 rows
#: the split count it had: 192 x 8K +8.3%, 96 x 32K +1.3-2.0%, 192 x 1K +0.3-0.5%, 96 x 8K even (two rounds each,
#: docs/lab-notes.md 16); 1,056 rounded up lost 3-5% at 64 x 8K, 128 x 8K and 64 x 32K (their grids grow past
#: 1,024), and 2 or 3 splits at 256 x 1K lost 2% and 4%. ``pdl_max_programs``: a split kernel takes the step's
#: PDL when its grid has at most this many programs (0: never; long programs scheduled early land unevenly on the
#: SMs, 15% slower at 32K and batch 20-24, docs/lab-notes.md 2f). Batch 1 at 1K (docs/lab-notes.md 16, two rounds): the
#: Gluon kernel's 72 programs +1.9% in the step, 256 at batch 4 -7%; the BF16 kernel's 16 +0.7%, 64 at batch 4 -1.4%.
#: The Triton FP4 kernel and the wide heads are not measured with it.
CONFIG = {
    "fp4": {"block_t": 128, "num_warps": 4, "num_stages": 3, "pdl_max_programs": 0},
    "dense": {"block_t": 64, "num_warps": 4, "num_stages": 2, "pdl_max_programs": 16},
    "hopper": {
        "block_t": 64,
        "pdl_max_programs": 128,
        "stages": 2,
        "small_batch": {"max_batch": 4, "block_t": 32, "stages": 3},
        "prefetch": True,
        "maxnreg": None,
        "target_programs": 1024,
        "round_splits_up": True,
        "min_chunk": 64,
        "max_splits": 128,
        "wide_heads": {
            "min_head_dim": 256,
            "block_t": 32,
            "stages": 2,
            "target_programs": 2112,
            "round_splits_up": False,
            "pdl_max_programs": 0,
        },
    },
    "target_programs": 264,
    "min_chunk": 256,
    "ptx": True,
}


def uses_hopper_kernel(fp4: bool, head_dim: int, device: torch.device | str) -> bool:
    """Whether `decode_attention` runs the Gluon kernel: an FP4 cache, a head size that is a multiple of 128 (the
    kernel's 16-row MMA tiles of code words), an sm_90+ GPU and a Triton with Gluon's MMA layouts."""
    device = torch.device(device)
    if not (fp4 and CONFIG["hopper"] and head_dim % 128 == 0) or INTERPRETED or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0) and gluon_module("fp4_attention_hopper") is not None


def _cache_args(cache: KVCache):
    if cache.fp4:
        return cache.k, cache.k_scale, cache.k_g, cache.v, cache.v_scale, cache.v_g
    return cache.k, cache.k, cache.k, cache.v, cache.v, cache.v


def qkv_post(
    qkv: torch.Tensor,
    cache: KVCache,
    positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    eps: float = 1e-6,
    q_out: torch.Tensor | None = None,
    round_like_torch: bool = False,
) -> torch.Tensor:
    """Normalize and rotate Q and K of the decode tokens, write K and V at ``positions`` (one per sequence).

    ``qkv`` [B, >= (Hq + 2 Hkv) * D] (q, k, v heads first, in that order; more columns, e.g. an output gate, are
    not read); ``cos``/``sin`` [Tpos, R] tables (RoPE off if None; R < D: partial rotary on each head's first R
    dims); ``q_norm``/``k_norm`` [D] (norm off if None). ``round_like_torch``: round to ``qkv.dtype`` after the norm
    and each RoPE op, as transformers' ops do (Qwen3.5's engine), instead of fp32 throughout (Qwen3's). Returns Q
    [B, Hq, D] in ``qkv.dtype``.
    """
    check_device(qkv)
    B = qkv.shape[0]
    D = cache.head_dim
    if qkv.shape[1] < (num_heads + 2 * num_kv_heads) * D:
        raise ValueError(f"qkv_post: qkv has {qkv.shape[1]} columns, fewer than the (Hq + 2 Hkv) * D = "
                         f"{(num_heads + 2 * num_kv_heads) * D} of {num_heads} + 2 x {num_kv_heads} heads of {D}.")  # fmt: skip
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    q_out = torch.empty(B, num_heads, D, dtype=qkv.dtype, device=qkv.device) if q_out is None else q_out
    norm, rope = q_norm is not None, cos is not None
    R = cos.shape[-1] if rope else D
    if rope and (R > D or R % 2 or sin.shape[-1] != R):
        raise ValueError(f"qkv_post: cos and sin must be [positions, R] with R even and at most head_dim {D}, got "
                         f"{list(cos.shape)} and {list(sin.shape)}.")  # fmt: skip
    dummy = qkv
    _qkv_post_kernel[(B, num_heads + num_kv_heads)](
        qkv, qkv.stride(0), q_norm if norm else dummy, k_norm if norm else dummy, cos if rope else dummy,
        sin if rope else dummy, positions, q_out, *_cache_args(cache), cache.max_len, eps,
        HQ=num_heads, HKV=num_kv_heads, D=D, NORM=norm, ROPE=rope, R=R, ROUND=round_like_torch, KV_FP4=cache.fp4,
        num_warps=1, enable_fp_fusion=False, **launch_options(qkv.device),
    )  # fmt: skip
    return q_out


def hopper_config(batch: int, head_dim: int = 128) -> dict:
    """``CONFIG["hopper"]`` for a batch of ``batch`` sequences with heads of ``head_dim``: its ``wide_heads``
    settings from that entry's ``min_head_dim`` on, then its ``small_batch`` tile and ring depth up to that entry's
    ``max_batch`` (a few sequences have few programs, which shorter tiles and a deeper ring serve better: 7.0
    against 8.3 us at batch 1 and 1K, docs/lab-notes.md 2e)."""
    cfg = CONFIG["hopper"]
    wide = cfg.get("wide_heads")
    if wide and head_dim >= wide["min_head_dim"]:
        cfg = {**cfg, **{k: v for k, v in wide.items() if k != "min_head_dim"}}
    small = cfg.get("small_batch")
    if small and batch <= small["max_batch"]:
        return {**cfg, **{k: v for k, v in small.items() if k != "max_batch"}}
    return cfg


def num_splits(
    batch: int, num_kv_heads: int, max_len: int, hopper: bool = False, head_dim: int = 128
) -> tuple[int, int]:
    """(splits, chunk) for a cache of ``max_len`` tokens: enough programs to fill the GPU, chunks of at least
    ``min_chunk`` tokens (a multiple of the tile). Static per cache size, so a captured graph keeps it. ``hopper``:
    for the Gluon kernel (`uses_hopper_kernel`), which runs more, smaller programs (``hopper_config`` of
    ``head_dim``)."""
    cfg = hopper_config(batch, head_dim) if hopper else CONFIG
    bt = cfg["block_t"] if hopper else max(CONFIG["fp4"]["block_t"], CONFIG["dense"]["block_t"])
    per_split = max(1, batch * num_kv_heads)
    up = hopper and cfg.get("round_splits_up", False)
    want = max(1, -(-cfg["target_programs"] // per_split) if up else cfg["target_programs"] // per_split)
    chunk = max(cfg["min_chunk"], triton.cdiv(max_len, want), triton.cdiv(max_len, cfg.get("max_splits", max_len)))
    chunk = triton.cdiv(chunk, bt) * bt
    return triton.cdiv(max_len, chunk), chunk


def split_launch_options(programs: int, cfg: dict, device: torch.device) -> dict:
    """A split kernel's PDL arguments: `launch_options` for a grid of at most ``cfg["pdl_max_programs"]`` programs,
    else none (the few long programs of a large grid, scheduled early, land unevenly on the SMs)."""
    return launch_options(device) if programs <= cfg.get("pdl_max_programs", 0) else {"PDL": False}


def decode_attention(
    q: torch.Tensor,
    cache: KVCache,
    lengths: torch.Tensor,
    sm_scale: float | None = None,
    splits: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its cache: ``q`` [B, Hq, D], ``lengths`` [B] (valid cache
    tokens, the current one included) -> [B, Hq, D] in ``q.dtype``. GQA: query head h reads KV head h // (Hq/Hkv).
    """
    check_device(q)
    B, HQ, D = q.shape
    HKV, T = cache.k.shape[1], cache.max_len
    group = HQ // HKV
    hopper = uses_hopper_kernel(cache.fp4, D, q.device)
    S, chunk = splits or num_splits(B, HKV, T, hopper, D)
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    o = torch.empty(B, HQ, S, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, HQ, S, dtype=torch.float32, device=q.device)
    if hopper:
        cfg = hopper_config(B, D)
        pdl = split_launch_options(B * HKV * S, cfg, q.device)
        gluon_module("fp4_attention_hopper").attn_split_kernel[(B, HKV, S)](
            q.contiguous(), *_cache_args(cache), lengths, o, lse, sm_scale, T, chunk,
            HQ=HQ, HKV=HKV, S=S, D=D, GROUP=group, G_PAD=max(8, triton.next_power_of_2(group)),
            BLOCK_T=cfg["block_t"], PREFETCH=cfg["prefetch"], STAGES=cfg["stages"], num_warps=1, maxnreg=cfg["maxnreg"],
            enable_fp_fusion=True, **pdl,
        )  # fmt: skip
    else:
        cfg = CONFIG["fp4" if cache.fp4 else "dense"]
        pdl = split_launch_options(B * HKV * S, cfg, q.device)
        _attn_split_kernel[(B, HKV, S)](
            q.contiguous(), *_cache_args(cache), lengths, o, lse, sm_scale, T, chunk,
            HQ=HQ, HKV=HKV, S=S, D=D, GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)),
            BLOCK_T=cfg["block_t"], KV_FP4=cache.fp4, DOT_BF16=DOT_BF16,
            PTX=CONFIG["ptx"] and cache.fp4 and not INTERPRETED and hardware_fp8(q.device),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=True, **pdl,
        )  # fmt: skip
    out = torch.empty(B, HQ, D, dtype=q.dtype, device=q.device) if out is None else out
    s_pad = max(2, triton.next_power_of_2(S))
    # Up to 32 x 128 partial values per program, and at least 256 programs (batch 1's 32 rows keep one each).
    rows = max(1, min(8, 32 // s_pad, B * HQ // 256))
    rows = 1 << (rows.bit_length() - 1)  # a power of two (tl.arange): batches past 64 rows come in multiples of 64
    _combine_kernel[(triton.cdiv(B * HQ, rows),)](
        o, lse, out, B * HQ, S=S, S_PAD=s_pad, D=D, ROWS=rows, num_warps=4, enable_fp_fusion=True,
        **launch_options(q.device),
    )  # fmt: skip
    return out


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, sm_scale=None):
    """fp32 torch reference: ``q`` [B, Hq, D], ``k``/``v`` [B, Hkv, T, D] (already dequantized values)."""
    B, HQ, D = q.shape
    group = HQ // k.shape[1]
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("bhd,bhtd->bht", q.float(), k) * sm_scale
    t = torch.arange(k.shape[2], device=q.device)
    s = s.masked_fill(t[None, None, :] >= lengths.to(q.device)[:, None, None], float("-inf"))
    return torch.einsum("bht,bhtd->bhd", torch.softmax(s, dim=-1), v)
