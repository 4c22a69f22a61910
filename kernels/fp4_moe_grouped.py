# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The routed experts' backend for calls with hundreds of tokens per expert (`fp4_moe_configs.GROUPED`: prefill,
training forwards): the weights, the input and the hidden decoded to exact bf16 once per call, then grouped GEMMs
over `moe_align`'s expert segments, torch's (``bf16_sums``: sums rounded to bf16) or Triton's (fp32 sums, the other
backends' function), with the other backends' epilogues.

Why: compute-bound prefill is faster on decoded operands than with the decoding inside the GEMM's loop.
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.fp4_moe_grouped (see kernels/README.md), not kernels.fp4_moe_grouped.")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trace_hf.kernels.common import DOT_BF16, e2m1_times_2_pow_m14, e4m3_hw  # noqa: E402
from trace_hf.kernels.fp4_moe_common import (  # noqa: E402
    dot_nt,
    down_input,
    pick,
    row_block,
    silu_mul_store,
    slot_rows,
)
from trace_hf.kernels.moe_align import moe_align  # noqa: E402


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])  # token counts: see kernels/README.md
def _grouped_combine_kernel(
    out_ptr,  # bf16 [P, H]: the grouped down GEMM of the decoded hidden (``E2M1 * s`` operands), by sorted position
    hg_ptr,  # [P] fp32 row scales of the hidden
    wg_ptr,  # [E] fp32
    tw_ptr,  # routing weights [M * K] fp32
    ids_ptr,  # [M * K] int expert of each slot
    rows_ptr,  # [M * K] int64 sorted position of each slot
    y_ptr,  # out: fp32 [M, H] (REDUCE: each token's slots summed in order k = 0 .. K - 1) or [M, K, H]
    M,
    H,
    K: tl.constexpr,
    REDUCE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """`_down_kernel`'s epilogue (global scales, routing weight) on a grouped GEMM's output, by token."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = t < M
    ok = t_ok[:, None] & (offs_n < H)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(K):
        slot = t.to(tl.int64) * K + k
        p = tl.load(rows_ptr + slot, mask=t_ok, other=0)
        v = tl.load(out_ptr + p[:, None] * H + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
        v = v * tl.load(hg_ptr + p, mask=t_ok, other=0.0)[:, None]
        v = v * tl.load(wg_ptr + tl.load(ids_ptr + slot, mask=t_ok, other=0), mask=t_ok, other=0.0)[:, None]
        v = v * tl.load(tw_ptr + slot, mask=t_ok, other=0.0)[:, None]
        if REDUCE:
            acc += v
        else:
            tl.store(y_ptr + slot[:, None] * H + offs_n[None, :], v, mask=ok)
    if REDUCE:
        tl.store(y_ptr + t.to(tl.int64)[:, None] * H + offs_n[None, :], acc, mask=ok)


@triton.jit(do_not_specialize=["num_slots", "num_pid_m"])  # token counts: see kernels/README.md
def _grouped_gemm_kernel(
    a_ptr,  # bf16 exact operand rows [*, KD]: x [M, H] (GATE_UP: row = slot // top_k) or the hidden [P, I] by position
    w_ptr,  # bf16 exact weights [E, N or 2N (GATE_UP: gate rows, then up rows), KD]
    ag_ptr,  # fp32 row scales of the rows of a: x [M] or the hidden [P]
    wg_ptr,  # [E] fp32
    tw_ptr,  # down: routing weights [num_slots] fp32
    out_ptr,  # GATE_UP: fp32 [P, N] SiLU(gate) * up by sorted position (padding rows 0); down: fp32 [num_slots, N]
    sorted_ptr,
    expert_ptr,
    num_slots,
    top_k,
    N,
    KD,
    num_pid_m,
    GATE_UP: tl.constexpr,
    DOT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """A tile of the grouped path's GEMMs with fp32 sums (what torch's grouped GEMM rounds to bf16) and the epilogues
    of `_gate_up_kernel` / `_down_kernel`, in their order. Tiles run GROUP_M row blocks at a time across all of N, so
    an expert's rows and weights come from L2. The host checks that the tiles divide N and KD: no load is masked
    (padding rows read a real row; they are stored as zeros (gate/up) or not at all (down))."""
    pid = tl.program_id(0)
    width = GROUP_M * (N // BLOCK_N)
    first_m = (pid // width) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    e = tl.load(expert_ptr + pid_m)
    if e < 0:
        return
    offs_p, slot, valid = row_block(sorted_ptr, pid_m, num_slots, BLOCK_M)
    if GATE_UP:
        row = tl.where(valid, slot // top_k, 0)
    else:
        row = offs_p
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)[None, :]
    a_rows = a_ptr + row.to(tl.int64)[:, None] * KD + kk
    w_rows = w_ptr + (e.to(tl.int64) * (2 * N if GATE_UP else N) + offs_n)[:, None] * KD + kk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, KD, BLOCK_K):
        a = tl.load(a_rows + k0)
        acc = dot_nt(a, tl.load(w_rows + k0), acc, DOT_BF16)
        if GATE_UP:
            acc_u = dot_nt(a, tl.load(w_rows + N * KD + k0), acc_u, DOT_BF16)
    if GATE_UP:
        silu_mul_store(acc, acc_u, ag_ptr, wg_ptr, out_ptr, e, row, valid, offs_p, offs_n, offs_n < N, N, True, True)
    else:
        acc = acc * tl.load(ag_ptr + offs_p, mask=valid, other=0.0)[:, None]
        acc = acc * tl.load(wg_ptr + e)
        acc = acc * tl.load(tw_ptr + slot, mask=valid, other=0.0)[:, None]
        out = out_ptr + tl.where(valid, slot, 0).to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(out, acc, mask=valid[:, None])


@triton.jit(do_not_specialize=["R"])  # token counts: see kernels/README.md
def _decode_rows_kernel(q_ptr, s_ptr, out_ptr, R, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``E2M1(code) * s`` of packed NVFP4 rows [R, K] as bf16, the grouped GEMMs' operands: exact (at most 6
    significant bits), so the conversion never rounds, on the GPU or in the interpreter. The decoding is
    `load_halves`' cheap one (``E2M1 * 2^-14`` from integer operations, the 2^14 in the block scale), not
    `fp4_quant.dequantize`'s, whose global scale and bf16 rounding logic these exact values do not need."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    r = rows.to(tl.int64)[:, None]
    ok = (rows < R)[:, None]
    k0 = tl.program_id(1) * BLOCK_K
    p = tl.load(q_ptr + r * (K // 2) + (k0 // 2 + tl.arange(0, BLOCK_K // 2)[None, :]), mask=ok, other=0)
    p = p.to(tl.int32) & 0xFF
    sb = tl.load(s_ptr + r * (K // 16) + (k0 // 16 + tl.arange(0, BLOCK_K // 16)[None, :]), mask=ok, other=0)
    s = e4m3_hw(sb.to(tl.uint8, bitcast=True)) * 16384.0
    s = tl.reshape(tl.broadcast_to(s[:, :, None], [ROWS, BLOCK_K // 16, 8]), [ROWS, BLOCK_K // 2])
    lo, hi = e2m1_times_2_pow_m14(p & 15) * s, e2m1_times_2_pow_m14(p >> 4) * s
    v = tl.reshape(tl.join(lo, hi), [ROWS, BLOCK_K])  # element 2i is the low nibble, 2i + 1 the high one
    out = out_ptr + r * K + k0 + tl.arange(0, BLOCK_K)[None, :]
    tl.store(out, v.to(tl.bfloat16), mask=ok)


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------


def experts_bf16(cfg, xq, topk_ids, topk_weights, w_gate_up, w_down, align_backend, return_hidden, reduce):
    """`fp4_moe.experts_from_quantized` for W4A4 with many tokens per expert and ``bf16_sums`` (`GROUPED`): the
    weights, the input and the hidden are decoded to bf16 as ``E2M1 * s`` (exact), once per call, and multiplied over
    `moe_align`'s segments by torch's grouped GEMM, whose sums are rounded to bf16 (a relative 2^-9) before the fp32
    epilogues; the global scales, SiLU * up, the hidden's quantization (and hints) and the routing weights are the
    other kernels' epilogues. `experts_fp32` is the same with fp32 sums."""
    M, K = topk_ids.shape
    n, E, H = M * K, w_gate_up.shape[0], w_gate_up.shape[2]
    bm = cfg["block_m"]
    # Grouped GEMM segments must come in expert order: the one-token layout of "auto" (row block k = slot k) is not.
    sorted_ids, expert_ids = moe_align(
        topk_ids, E, bm, "torch" if align_backend == "auto" and M == 1 else align_backend
    )
    blocks = torch.zeros(E + 1, dtype=torch.int32, device=sorted_ids.device)
    blocks.scatter_add_(0, torch.where(expert_ids >= 0, expert_ids, E).long(), torch.ones_like(expert_ids))
    offsets = (blocks[:E] * bm).cumsum(0, dtype=torch.int32)  # rows past the last offset: not computed, not read
    rows = (sorted_ids.long() // K).clamp_(max=M - 1)  # padding rows read a real token; their outputs are dropped
    dr = cfg["decode_rows"]
    a = _exact_bf16(xq.packed[rows], xq.block_scale[rows], dr)
    gate_up = _grouped_mm(a, _exact_bf16(w_gate_up.packed, w_gate_up.block_scale, dr), offsets)
    del a
    xg, wgug = (
        xq.global_scale.reshape(-1).float().contiguous(),
        w_gate_up.global_scale.reshape(-1).float().contiguous(),
    )
    hq, hidden = down_input(gate_up[None], xg, wgug, sorted_ids, expert_ids, n, K, bm, True, True, True, return_hidden)
    del gate_up
    h = _exact_bf16(hq.packed, hq.block_scale, dr)
    out = _grouped_mm(h, _exact_bf16(w_down.packed, w_down.block_scale, dr), offsets)
    del h
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    wdg = w_down.global_scale.reshape(-1).float().contiguous()
    y = torch.empty((M, H) if reduce else (M, K, H), dtype=torch.float32, device=out.device)
    _grouped_combine_kernel[(triton.cdiv(M, 16), triton.cdiv(H, 128))](
        out, hq.global_scale.reshape(-1), wdg, tw, topk_ids.reshape(-1), slot_rows(sorted_ids, n), y, M, H,
        K=K, REDUCE=reduce, BLOCK_T=16, BLOCK_N=128, num_warps=4, enable_fp_fusion=True,
    )  # fmt: skip
    return y, hidden


def experts_fp32(cfg, xq, topk_ids, topk_weights, w_gate_up, w_down, align_backend, return_hidden):
    """The grouped path with fp32 GEMM sums (`_grouped_gemm_kernel`, ``GROUPED["fp32_sums"]``): the function of the
    wgmma kernels, and their outputs' layout, the weighted slots side by side [M, K, H], which the caller sums as it
    sums theirs (so a training forward, which sums outside, gets the bits of the eval forward). The input is decoded once per token (the kernel
    gathers the rows); SiLU * up and the down epilogue run in the GEMMs; the hidden is quantized as theirs."""
    t = cfg["fp32"]
    M, K = topk_ids.shape
    n, E, H, NI = M * K, w_gate_up.shape[0], w_gate_up.shape[2], w_gate_up.shape[1] // 2
    bm, dr, dev = t["block_m"], cfg["decode_rows"], xq.packed.device
    sorted_ids, expert_ids = moe_align(topk_ids, E, bm, align_backend)
    P = sorted_ids.numel()
    xg = xq.global_scale.reshape(-1).float().contiguous()
    wgug = w_gate_up.global_scale.reshape(-1).float().contiguous()
    h = torch.empty(P, NI, dtype=torch.float32, device=dev)
    _grouped_gemm(t, _exact_bf16(xq.packed, xq.block_scale, dr), w_gate_up, xg, xg, h, sorted_ids, expert_ids, n, K,
                  dr, gate_up=True)  # fmt: skip
    hq, hidden = down_input(h, xg, wgug, sorted_ids, expert_ids, n, K, bm, True, True, True, return_hidden)
    del h
    y = torch.empty(M, K, H, dtype=torch.float32, device=dev)
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(t, _exact_bf16(hq.packed, hq.block_scale, dr), w_down, hq.global_scale.reshape(-1), tw, y,
                  sorted_ids, expert_ids, n, K, dr, gate_up=False)  # fmt: skip
    return y, hidden


def _grouped_gemm(t, a, w, ag, tw, out, sorted_ids, expert_ids, num_slots, top_k, decode_rows, gate_up):
    """`_grouped_gemm_kernel` of the decoded rows ``a`` [*, KD] times ``w`` (`FP4Tensor` [E, N (gate/up: 2N), KD],
    decoded here) into ``out`` (its last dimension N), ``t``: ``GROUPED["fp32"]``."""
    wb = _exact_bf16(w.packed, w.block_scale, decode_rows)
    wg = w.global_scale.reshape(-1).float().contiguous()
    N, KD, bm = out.shape[-1], a.shape[1], t["block_m"]
    bn = t["block_n_gate_up" if gate_up else "block_n_down"]
    num_pid_m = sorted_ids.numel() // bm
    _grouped_gemm_kernel[(num_pid_m * (N // bn),)](
        a, wb, ag, wg, tw, out, sorted_ids, expert_ids, num_slots, top_k, N, KD, num_pid_m,
        GATE_UP=gate_up, DOT_BF16=DOT_BF16, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=t["block_k"], GROUP_M=t["group_m"],
        num_warps=t["num_warps"], num_stages=t["num_stages"], enable_fp_fusion=False,
    )  # fmt: skip


def _exact_bf16(packed: torch.Tensor, block_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """``E2M1(code) * s`` in bf16 (`_decode_rows_kernel`), without the global scale; the shape of the unpacked
    values: as ``FP4Tensor(packed, block_scale, 1).dequantize(torch.bfloat16)``; ``rows`` per program."""
    packed, block_scale = packed.contiguous(), block_scale.contiguous()
    K = packed.shape[-1] * 2
    R = packed.numel() // packed.shape[-1]
    out = torch.empty(packed.shape[:-1] + (K,), dtype=torch.bfloat16, device=packed.device)
    block_k = pick(K, 256)
    _decode_rows_kernel[(triton.cdiv(R, rows), K // block_k)](
        packed, block_scale, out, R, K, ROWS=rows, BLOCK_K=block_k, num_warps=4, enable_fp_fusion=True
    )
    return out


def _grouped_mm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of ``a`` (segments ending at ``offsets``) times ``w[e].T`` (``w`` [E, N, K]), bf16."""
    mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return mm(a, w.transpose(-2, -1), offs=offsets)
