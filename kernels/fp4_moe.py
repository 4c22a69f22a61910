# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Routed experts in Triton with packed NVFP4 weights (W4A4), for rollout decode and prefill.

Hopper has no FP4 tensor cores, so the speed comes from bytes: the kernels stream packed E2M1 codes (half a
byte per weight) plus E4M3 block scales, decode them in registers to exact operands (``E2M1 * s`` has at most
6 significant bits, so it is exact in bf16) and accumulate in fp32 with ``tl.dot``; the fp32 global scales
(``g_x`` per token row, ``g_w`` per expert) are applied once in the epilogue.

Pipeline of `fp4_moe_experts` (the same function as `TraceFP4Experts`' eval path, computed numerically, not bit
for bit: the dot products sum in another order than torch's matmul, so the hidden activation can differ in its
last fp32 bits and, rarely, round to a neighbouring FP4 code):

1. the input ``x`` is quantized per token (NVFP4 row scale) by `trace_hf.kernels.fp4_quant.quantize`, which
   also gives the hints of the token in the same pass (the decode step does it in its RMSNorm kernel,
   `decode_ops.add_rmsnorm_fp4`, and calls `experts_from_quantized`);
2. `moe_align`: (token, slot) pairs sorted by expert, each expert's segment padded to ``BLOCK_M`` rows (as
   vLLM's ``moe_align_block_size``), so every row block of the GEMMs belongs to one expert;
3. `_gate_up_kernel`: gate and up projections of a row block in one pass over the input, then SiLU(gate) * up
   (with ``split_k`` > 1, each program covers a slice of K and `_silu_mul_kernel` sums the slices in order);
4. the hidden activation is quantized per (token, expert) row, exactly as ``fp4.quantize(h, "nvfp4", "row")`` (with
   split-K in the same launch as the partial sums, `_hidden`);
5. `_down_kernel`: down projection, times the routing weight, written per slot; the caller sums the top-k
   slots of a token (the decode step fuses that sum into its next RMSNorm).

On sm_90+ (measured on the H200) W4A4 decode calls run steps 3 and 5 in the Gluon kernels of `fp4_moe_hopper`
instead (`HOPPER`; same inputs and outputs, no layout shuffle before the MMA), and past its last limit or from 16 slots
per expert (prefill, training forwards, decode from batch 129 at top-8 of 128 experts), the wgmma kernels of `fp4_moe_wgmma`
(`WGMMA`: wide token blocks, each weight decoded once per block). Calls that ask for it (``bf16_sums=True``, the
opt-in `TraceFP4Config.prefill_bf16_gemms`) with hundreds of tokens per expert take `_experts_grouped` (`GROUPED`):
weights decoded once to exact bf16, torch's grouped GEMM, the same epilogues, GEMM sums rounded to bf16
(`moe_experts_reference(..., gemm_dtype=torch.bfloat16)`). With ``GROUPED["fp32_sums"]`` the other calls of that size
take it too, through Triton's grouped GEMM (`_grouped_gemm_kernel`) with fp32 sums: the wgmma kernels' function.
The Triton kernels also take dense (BF16) weights and activations (``W_FP4=False`` / ``A_FP4=False``): the BF16
baseline of the rollout benchmark runs the same code and differs only in the bytes it reads.

Dot operands: for W4A4 on the GPU, fp16 from the inline-PTX decoding `fp4_halves_f16` (exact; both operands
carry 2^-14, taken off the accumulator); otherwise bf16 on the GPU, and fp32 under ``TRITON_INTERPRET=1``, where
bf16 ``tl.dot`` is wrong (bf16 is raw uint16 there) and PTX does not run, with ``input_precision="ieee"``.
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.fp4_moe (see kernels/README.md), not kernels.fp4_moe.")

from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trace_hf import fp4  # noqa: E402
from trace_hf.fp4 import FP4Tensor  # noqa: E402
from trace_hf.kernels import fp4_quant  # noqa: E402
from trace_hf.kernels.common import (  # noqa: E402
    DOT_BF16,
    INTERPRETED,
    check_device,
    e2m1_times_2_pow_m14,
    e4m3_hw,
    hardware_fp8,
    load_fp4_rows,
    load_halves,
)
from trace_hf.kernels.fp4_moe_configs import (  # noqa: E402
    CONFIG,
    HIDDEN_LAUNCH,
    check_grouped_fp32,
    check_hopper_entry,
    check_wgmma_entry,
    gate_up_cap,
    grouped_config,
    hopper_config,
    launch_config,
    wgmma_config,
)
from trace_hf.kernels.moe_align import moe_align  # noqa: E402
from trace_hf.kernels.pdl import launch_options, wait_for_producer  # noqa: E402


@triton.jit
def _load_rows(ptr, q_s_ptr, rows, row_mask, k0, K, FP4: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    if FP4:
        return load_fp4_rows(ptr, q_s_ptr, rows, row_mask, k0, K, ROWS, BLOCK_K)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)[None, :]
        return tl.load(ptr + rows.to(tl.int64)[:, None] * K + kk, mask=row_mask[:, None], other=0.0)


@triton.jit
def _dot_nt(a, b, acc, DOT_BF16: tl.constexpr, PTX: tl.constexpr = False):
    """acc + a @ b.T with fp32 accumulation (bf16 operands on the GPU, exact fp32 in the interpreter; with ``PTX``
    the fp16 tiles of `fp4_halves_f16` as they are)."""
    if PTX:
        return tl.dot(a, tl.trans(b), acc)
    elif DOT_BF16:
        return tl.dot(a.to(tl.bfloat16), tl.trans(b.to(tl.bfloat16)), acc)
    else:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _row_block(sorted_ptr, pid_m, num_slots, BLOCK_M: tl.constexpr):
    """Sorted positions of row block ``pid_m``, their slots, and which are real (not padding)."""
    offs_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ptr + offs_p)
    return offs_p, slot, slot < num_slots


@triton.jit
def _gate_up_kernel(
    a_ptr,  # x: packed [M, H/2] (A_FP4) or dense [M, H]
    as_ptr,  # x block scales [M, H/16] (A_FP4)
    ag_ptr,  # x row scales [M] fp32 (A_FP4)
    w_ptr,  # W_gate_up: packed [E, 2I, H/2] (W_FP4) or dense [E, 2I, H]
    ws_ptr,  # [E, 2I, H/16]
    wg_ptr,  # [E] fp32
    h_ptr,  # out: SiLU(gate) * up, fp32 [P, I] by sorted position; with SPLIT_K > 1 the raw partial sums of
    # gate and up, fp32 [SPLIT_K, P, 2I], that `_silu_mul_kernel` finishes
    sorted_ptr,  # [P] int32 slot ids (token * top_k + k), num_slots for padding
    expert_ptr,  # [P / BLOCK_M] int32 expert of each row block, -1 past the end
    num_slots,
    top_k,
    H,
    NI,
    A_FP4: tl.constexpr,
    W_FP4: tl.constexpr,
    DOT_BF16: tl.constexpr,
    HALVES: tl.constexpr,
    PTX: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producer(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    e = tl.load(expert_ptr + pid_m)
    if e < 0:
        return
    offs_p, slot, valid = _row_block(sorted_ptr, pid_m, num_slots, BLOCK_M)
    row = tl.where(valid, slot // top_k, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < NI
    gate_rows = e.to(tl.int64) * (2 * NI) + offs_n
    up_rows = gate_rows + NI
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_len = H // SPLIT_K
    for k0 in range(pid_k * k_len, (pid_k + 1) * k_len, BLOCK_K):
        if HALVES:
            a0, a1 = load_halves(a_ptr, as_ptr, row, valid, k0, H, A_FP4, BLOCK_K, PTX)
            g0, g1 = load_halves(w_ptr, ws_ptr, gate_rows, n_ok, k0, H, W_FP4, BLOCK_K, PTX)
            u0, u1 = load_halves(w_ptr, ws_ptr, up_rows, n_ok, k0, H, W_FP4, BLOCK_K, PTX)
            acc_g = _dot_nt(a1, g1, _dot_nt(a0, g0, acc_g, DOT_BF16, PTX), DOT_BF16, PTX)
            acc_u = _dot_nt(a1, u1, _dot_nt(a0, u0, acc_u, DOT_BF16, PTX), DOT_BF16, PTX)
        else:
            a = _load_rows(a_ptr, as_ptr, row, valid, k0, H, A_FP4, BLOCK_M, BLOCK_K)
            wg = _load_rows(w_ptr, ws_ptr, gate_rows, n_ok, k0, H, W_FP4, BLOCK_N, BLOCK_K)
            wu = _load_rows(w_ptr, ws_ptr, up_rows, n_ok, k0, H, W_FP4, BLOCK_N, BLOCK_K)
            acc_g = _dot_nt(a, wg, acc_g, DOT_BF16)
            acc_u = _dot_nt(a, wu, acc_u, DOT_BF16)
    if PTX:  # both operands carried 2^-14
        acc_g = acc_g * 268435456.0
        acc_u = acc_u * 268435456.0
    if SPLIT_K == 1:
        _silu_mul_store(acc_g, acc_u, ag_ptr, wg_ptr, h_ptr, e, row, valid, offs_p, offs_n, n_ok, NI, A_FP4, W_FP4)
    else:
        part = (
            h_ptr + (pid_k * tl.num_programs(0) * BLOCK_M + offs_p).to(tl.int64)[:, None] * (2 * NI) + offs_n[None, :]
        )
        keep = valid[:, None] & n_ok[None, :]  # padding rows are not stored: `_silu_mul_kernel` does not read them
        tl.store(part, acc_g, mask=keep)
        tl.store(part + NI, acc_u, mask=keep)


@triton.jit
def _silu_mul(acc_g, acc_u, ag_ptr, wg_ptr, e, row, valid, A_FP4: tl.constexpr, W_FP4: tl.constexpr):
    """The gate/up epilogue's math: global scales, SiLU(gate) * up, padding rows zeroed (``row`` and ``valid``
    shaped to broadcast against the accumulators)."""
    if A_FP4:
        gx = tl.load(ag_ptr + row, mask=valid, other=0.0)
        acc_g = acc_g * gx
        acc_u = acc_u * gx
    if W_FP4:
        gw = tl.load(wg_ptr + e)
        acc_g = acc_g * gw
        acc_u = acc_u * gw
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    return tl.where(valid, h, 0.0)


@triton.jit
def _silu_mul_store(acc_g, acc_u, ag_ptr, wg_ptr, h_ptr, e, row, valid, offs_p, offs_n, n_ok, NI,
                    A_FP4: tl.constexpr, W_FP4: tl.constexpr):  # fmt: skip
    """The gate/up epilogue, stored by sorted position."""
    h = _silu_mul(acc_g, acc_u, ag_ptr, wg_ptr, e, row[:, None], valid[:, None], A_FP4, W_FP4)
    tl.store(h_ptr + offs_p.to(tl.int64)[:, None] * NI + offs_n[None, :], h, mask=n_ok[None, :])


@triton.jit
def _silu_mul_kernel(
    part_ptr,  # fp32 [SPLIT_K, P, 2I] partial gate / up sums of `_gate_up_kernel` (padding rows unwritten)
    ag_ptr,
    wg_ptr,
    h_ptr,  # out: fp32 [P, I]; with QUANT the packed codes [P, I / 2]
    sb_ptr,  # with QUANT: out, scale bytes [P, I / 16]
    hg_ptr,  # with QUANT: out, row scales [P]
    hb_ptr,  # with WRITE_BITS: out, hint bits [P, I / 8]
    sorted_ptr,
    expert_ptr,
    num_slots,
    top_k,
    NI,
    P,
    A_FP4: tl.constexpr,
    W_FP4: tl.constexpr,
    SPLIT_K: tl.constexpr,
    QUANT: tl.constexpr,
    WRITE_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIGN_M: tl.constexpr,  # rows of `moe_align`'s expert blocks (a multiple of BLOCK_M)
    PDL: tl.constexpr,
):
    """Split-K gate/up: sums the partials in split order (deterministic), then the same epilogue. With QUANT a
    program holds whole rows (BLOCK_N >= I) and writes them quantized as `_quantize_hidden` would: the hidden
    activation never goes to memory in fp32 (batch 1's path, where each launch costs more than its bytes)."""
    wait_for_producer(PDL)
    pid_m = tl.program_id(0)
    e = tl.load(expert_ptr + pid_m // (ALIGN_M // BLOCK_M))
    if e < 0:
        return
    offs_p, slot, valid = _row_block(sorted_ptr, pid_m, num_slots, BLOCK_M)
    row = tl.where(valid, slot // top_k, 0)
    if QUANT:
        # Whole rows as [BLOCK_M, NBT, 16]: a thread holds NVFP4 blocks, the layout `quantize_rows_nvfp4` takes.
        NBT: tl.constexpr = BLOCK_N // 16
        blks = tl.arange(0, NBT)
        cols = (blks[:, None] * 16 + tl.arange(0, 16)[None, :])[None, :, :]
        c_ok = cols < NI
        rows = offs_p.to(tl.int64)[:, None, None]
        ld_ok = c_ok & valid[:, None, None]  # the gate/up kernels store no padding rows
        acc_g = tl.zeros([BLOCK_M, NBT, 16], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, NBT, 16], dtype=tl.float32)
        for k in tl.static_range(SPLIT_K):
            part = part_ptr + (k * P + rows) * (2 * NI) + cols
            acc_g += tl.load(part, mask=ld_ok, other=0.0)
            acc_u += tl.load(part + NI, mask=ld_ok, other=0.0)
        h = _silu_mul(acc_g, acc_u, ag_ptr, wg_ptr, e, row[:, None, None], valid[:, None, None], A_FP4, W_FP4)
        fp4_quant.quantize_rows_nvfp4(tl.where(c_ok, h, 0.0), offs_p.to(tl.int64), offs_p < P, blks, NI, h_ptr,
                                      sb_ptr, hg_ptr, hb_ptr, WRITE_BITS, BLOCK_M, NBT)  # fmt: skip
    else:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < NI
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        ld_ok = valid[:, None] & n_ok[None, :]
        for k in tl.static_range(SPLIT_K):
            part = part_ptr + (k * P + offs_p).to(tl.int64)[:, None] * (2 * NI) + offs_n[None, :]
            acc_g += tl.load(part, mask=ld_ok, other=0.0)
            acc_u += tl.load(part + NI, mask=ld_ok, other=0.0)
        _silu_mul_store(acc_g, acc_u, ag_ptr, wg_ptr, h_ptr, e, row, valid, offs_p, offs_n, n_ok, NI, A_FP4, W_FP4)


@triton.jit
def _down_kernel(
    a_ptr,  # h: packed [P, I/2] (A_FP4) or dense [P, I], by sorted position
    as_ptr,  # [P, I/16]
    ag_ptr,  # [P] fp32
    w_ptr,  # W_down: packed [E, H, I/2] (W_FP4) or dense [E, H, I]
    ws_ptr,  # [E, H, I/16]
    wg_ptr,  # [E] fp32
    tw_ptr,  # routing weights [num_slots] fp32
    y_ptr,  # out: fp32 [num_slots, H], weighted expert outputs by slot
    sorted_ptr,
    expert_ptr,
    num_slots,
    H,
    NI,
    A_FP4: tl.constexpr,
    W_FP4: tl.constexpr,
    DOT_BF16: tl.constexpr,
    HALVES: tl.constexpr,
    PTX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producer(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(expert_ptr + pid_m)
    if e < 0:
        return
    offs_p, slot, valid = _row_block(sorted_ptr, pid_m, num_slots, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    w_rows = e.to(tl.int64) * H + offs_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, NI, BLOCK_K):
        if HALVES:
            a0, a1 = load_halves(a_ptr, as_ptr, offs_p, valid, k0, NI, A_FP4, BLOCK_K, PTX)
            w0, w1 = load_halves(w_ptr, ws_ptr, w_rows, n_ok, k0, NI, W_FP4, BLOCK_K, PTX)
            acc = _dot_nt(a1, w1, _dot_nt(a0, w0, acc, DOT_BF16, PTX), DOT_BF16, PTX)
        else:
            a = _load_rows(a_ptr, as_ptr, offs_p, valid, k0, NI, A_FP4, BLOCK_M, BLOCK_K)
            w = _load_rows(w_ptr, ws_ptr, w_rows, n_ok, k0, NI, W_FP4, BLOCK_N, BLOCK_K)
            acc = _dot_nt(a, w, acc, DOT_BF16)
    if PTX:
        acc = acc * 268435456.0
    if A_FP4:
        acc = acc * tl.load(ag_ptr + offs_p, mask=valid, other=0.0)[:, None]
    if W_FP4:
        acc = acc * tl.load(wg_ptr + e)
    tw = tl.load(tw_ptr + slot, mask=valid, other=0.0)
    acc = acc * tw[:, None]
    out = y_ptr + tl.where(valid, slot, 0).to(tl.int64)[:, None] * H + offs_n[None, :]
    tl.store(out, acc, mask=valid[:, None] & n_ok[None, :])


@triton.jit
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


@triton.jit
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
    offs_p, slot, valid = _row_block(sorted_ptr, pid_m, num_slots, BLOCK_M)
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
        acc = _dot_nt(a, tl.load(w_rows + k0), acc, DOT_BF16)
        if GATE_UP:
            acc_u = _dot_nt(a, tl.load(w_rows + N * KD + k0), acc_u, DOT_BF16)
    if GATE_UP:
        _silu_mul_store(acc, acc_u, ag_ptr, wg_ptr, out_ptr, e, row, valid, offs_p, offs_n, offs_n < N, N, True, True)
    else:
        acc = acc * tl.load(ag_ptr + offs_p, mask=valid, other=0.0)[:, None]
        acc = acc * tl.load(wg_ptr + e)
        acc = acc * tl.load(tw_ptr + slot, mask=valid, other=0.0)[:, None]
        out = out_ptr + tl.where(valid, slot, 0).to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(out, acc, mask=valid[:, None])


@triton.jit
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


def _pick(n: int, preferred: int) -> int:
    """Largest power of two <= preferred that divides n (at least 16: NVFP4 blocks, tl.dot minimum)."""
    b = preferred
    while b > 16 and n % b:
        b //= 2
    if n % b:
        raise ValueError(f"Dimension {n} is not a multiple of 16.")
    return b


def _ptx(cfg: dict, a_fp4: bool, w_fp4: bool) -> bool:
    """Whether a GEMM decodes with `fp4_halves_f16`: both operands packed FP4 (fp16 cannot hold bf16 activations
    exactly), halves layout, on the GPU (the interpreter runs no PTX)."""
    return bool(cfg.get("ptx")) and cfg["halves"] and a_fp4 and w_fp4 and not INTERPRETED


def _fp4_args(q: FP4Tensor | torch.Tensor):
    """(values or codes, block scales, global scales) as the kernels read them; dense tensors get dummies."""
    if isinstance(q, FP4Tensor):
        if q.fmt != "nvfp4":
            raise ValueError(f"The FP4 MoE kernels take NVFP4 tensors, got {q.fmt}.")
        return q.packed, q.block_scale, q.global_scale.reshape(-1).to(torch.float32).contiguous(), True
    return q.contiguous(), q, q, False


@dataclass
class QuantizedHidden:
    """The hidden activation as step 4 quantized it, rows in the sorted, padded layout of `moe_align`: ``q``
    [P, I] (padding rows are zeros), its ``hints`` (mantissa bits written in the same pass), ``slots`` [P] (the slot
    token * top_k + k of each row; padding holds ``num_slots``)."""

    q: FP4Tensor
    hints: fp4.FP4Hints
    slots: torch.Tensor
    num_slots: int

    def positions(self) -> torch.Tensor:
        """The row of every slot, [num_slots] int64: ``t[positions()]`` puts rows in slot order, padding dropped
        (no host sync, so a CUDA graph can capture it)."""
        return _slot_rows(self.slots, self.num_slots)


def _slot_rows(sorted_ids: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The sorted position of every slot, [num_slots] int64, from `moe_align`'s ``sorted_ids`` (no host sync)."""
    pos = torch.zeros(num_slots + 1, dtype=torch.int64, device=sorted_ids.device)
    rows = torch.arange(sorted_ids.numel(), device=sorted_ids.device)
    return pos.scatter_(0, sorted_ids.long(), rows)[:num_slots]  # padding rows all land on the extra one


def experts_from_quantized(
    xq: FP4Tensor | torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: FP4Tensor | torch.Tensor,
    w_down: FP4Tensor | torch.Tensor,
    hidden_fp4: bool | None = None,
    align_backend: str = "auto",
    return_hidden: bool = False,
    reduce: bool = False,
    bf16_sums: bool = False,
):
    """Routed experts on an already quantized input (`FP4Tensor` [M, H], or a dense [M, H] tensor).

    Weights are `FP4Tensor` (NVFP4, per-expert global scale: ``[E, 2I, H]`` and ``[E, H, I]``) or dense tensors
    of those shapes. ``topk_ids`` must be < E (checking would cost a host sync): `TraceFP4Experts` maps
    expert-parallel sentinels to weight 0 before calling. ``hidden_fp4`` (default: whether the weights are FP4) quantizes the hidden activation per
    (token, expert) row. Returns fp32 ``[M, top_k * s, H]``: each slot's expert output times its routing weight, as
    ``s`` partial sums over slices of the intermediate dimension (``s = 1`` but where a `HOPPER` entry sets
    ``split_k_down``: batch 1); the token's output is the sum over dim 1; with ``reduce``, that sum, fp32
    ``[M, H]`` (fused into the grouped path's epilogue). With ``return_hidden`` (FP4 hidden only) also returns the `QuantizedHidden` the down projection
    read, for recording experts_hidden hints. ``bf16_sums=True`` lets a call of many tokens per expert take the
    grouped path (`GROUPED`: bf16 GEMMs, their sums rounded to bf16 before the epilogues, ~1.3x faster at a
    16K-token prefill); otherwise every GEMM sum stays fp32, as decode's (`TraceFP4Config.prefill_bf16_gemms`),
    on the grouped path too where ``GROUPED["fp32_sums"]`` is on (Triton's GEMMs on its decoded operands).
    """
    y, hidden = _experts(xq, topk_ids, topk_weights, w_gate_up, w_down, hidden_fp4, align_backend, return_hidden,
                         reduce, bf16_sums)  # fmt: skip
    if reduce and y.ndim == 3:
        y = y.sum(1)
    return (y, hidden) if return_hidden else y


def _experts(xq, topk_ids, topk_weights, w_gate_up, w_down, hidden_fp4, align_backend, return_hidden, reduce,
             bf16_sums):  # fmt: skip
    """`experts_from_quantized` by path: (y, `QuantizedHidden` or None); y is [M, H] only from the grouped path."""
    x_arg, xs, xg, a_fp4 = _fp4_args(xq)
    wgu, wgus, wgug, w_fp4 = _fp4_args(w_gate_up)
    wd, wds, wdg, wd_fp4 = _fp4_args(w_down)
    if wd_fp4 != w_fp4:
        raise ValueError("Give both expert weights packed (FP4Tensor) or both dense.")
    hidden_fp4 = w_fp4 if hidden_fp4 is None else hidden_fp4
    if return_hidden and not hidden_fp4:
        raise ValueError("return_hidden needs the FP4 hidden activation (hidden_fp4=True): a dense one has no hints.")
    check_device(x_arg)
    E, two_i, H = w_gate_up.shape
    NI = two_i // 2
    M, K = topk_ids.shape
    n = M * K
    dev = x_arg.device
    w4a4 = a_fp4 and w_fp4 and hidden_fp4
    grouped = grouped_config(n, E, dev) if w4a4 else None
    if grouped is not None and (bf16_sums or (grouped.get("fp32_sums") and check_grouped_fp32(grouped, H, NI))):
        return _experts_grouped(
            grouped, xq, topk_ids, topk_weights, w_gate_up, w_down, align_backend, return_hidden, reduce, bf16_sums
        )
    wgmma = wgmma_config(n, E, dev) if w4a4 else None
    if wgmma is not None and not check_wgmma_entry(wgmma, H, NI):
        wgmma = None  # shapes the wgmma tiles do not divide: the decode kernels
    if wgmma is not None:
        sorted_ids, expert_ids = moe_align(topk_ids, E, wgmma["block_t"], align_backend)
        return _experts_wgmma(wgmma, x_arg, xs, xg, topk_weights, wgu, wgus, wgug, wd, wds, wdg, sorted_ids,
                              expert_ids, M, K, H, NI, return_hidden)  # fmt: skip
    hopper = hopper_config(n, dev) if w4a4 else None
    if hopper is not None and (H % hopper["block_k"] or NI % hopper["block_k"] or NI % hopper["block_n_gate_up"]
                               or H % hopper["block_n_down"]):  # fmt: skip
        hopper = None  # shapes the Gluon tiles do not divide: the Triton kernels
    cfg = launch_config(n, w_fp4)
    bm = hopper["block_t"] if hopper else cfg.get("block_m", CONFIG["block_m"])
    sorted_ids, expert_ids = moe_align(topk_ids, E, bm, align_backend)
    P = sorted_ids.numel()
    if hopper is not None:
        return _experts_hopper(hopper, x_arg, xs, xg, topk_weights, wgu, wgus, wgug, wd, wds, wdg, sorted_ids,
                               expert_ids, M, K, H, NI, return_hidden)  # fmt: skip
    if not hardware_fp8(dev):
        cfg = dict(cfg, halves=False, ptx=False)
    bk_h, bk_i = _pick(H, cfg["block_k"]), _pick(NI, cfg["block_k"])
    bn_gu, bn_d = cfg["block_n_gate_up"], cfg["block_n_down"]
    common = {
        "DOT_BF16": DOT_BF16,
        "BLOCK_M": bm,
        "num_warps": cfg["num_warps"],
        "num_stages": cfg["num_stages"],
        # BF16 weights: no PDL (decode at batch 1 ran 9% slower with it, docs/lab-notes.md).
        **(launch_options(dev) if w_fp4 else {"PDL": False}),
    }
    split = cfg.get("split_k", 1)
    while split > 1 and H % (split * bk_h):  # a launch knob: fewer splits where the K tiles do not divide evenly
        split //= 2
    part = _gate_up_out(split, P, NI, dev)
    _gate_up_kernel[(P // bm, triton.cdiv(NI, bn_gu), split)](
        x_arg, xs, xg, wgu, wgus, wgug, part, sorted_ids, expert_ids, n, K, H, NI,
        A_FP4=a_fp4, W_FP4=w_fp4, HALVES=cfg["halves"] and (a_fp4 or w_fp4), PTX=_ptx(cfg, a_fp4, w_fp4),
        SPLIT_K=split, BLOCK_N=bn_gu, BLOCK_K=bk_h, **common,
    )  # fmt: skip
    hq, hidden = _hidden(part, xg, wgug, sorted_ids, expert_ids, n, K, bm, a_fp4, w_fp4, hidden_fp4, return_hidden)
    if hidden_fp4:
        h_arg, hs, hg, h_is_fp4 = hq.packed, hq.block_scale, hq.global_scale.reshape(-1), True
    else:
        h_arg, hs, hg, h_is_fp4 = hq, hq, hq, False
    y = torch.empty(M, K, H, dtype=torch.float32, device=dev)
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _down_kernel[(P // bm, triton.cdiv(H, bn_d))](
        h_arg, hs, hg, wd, wds, wdg, tw, y, sorted_ids, expert_ids, n, H, NI,
        A_FP4=h_is_fp4, W_FP4=w_fp4, HALVES=cfg["halves"] and (h_is_fp4 or w_fp4), PTX=_ptx(cfg, h_is_fp4, w_fp4),
        BLOCK_N=bn_d, BLOCK_K=bk_i, **common,
    )  # fmt: skip
    return y, hidden


def _gate_up_out(split: int, P: int, NI: int, device) -> torch.Tensor:
    """What the gate/up kernels write: the hidden activation fp32 [P, I], or with split-K the partial gate and up
    sums fp32 [split, P, 2I] (padding rows left unwritten)."""
    shape = (P, NI) if split == 1 else (split, P, 2 * NI)
    return torch.empty(shape, dtype=torch.float32, device=device)


def _hidden(part, xg, wgug, sorted_ids, expert_ids, num_slots, top_k, block_m, a_fp4, w_fp4, hidden_fp4,
            return_hidden):  # fmt: skip
    """The down projection's input from the gate/up output ``part`` (`_gate_up_out`): the hidden activation,
    quantized when ``hidden_fp4`` (`FP4Tensor`, and with ``return_hidden`` its `QuantizedHidden`), else fp32.
    Split-K partials are summed by `_silu_mul_kernel`, which quantizes in the same launch (batch 1's path)."""
    if part.ndim == 2:
        return _quantize_hidden(part, sorted_ids, num_slots, return_hidden) if hidden_fp4 else (part, None)
    split, P, NI = part.shape[0], part.shape[1], part.shape[2] // 2
    dev = part.device
    common = {"A_FP4": a_fp4, "W_FP4": w_fp4, "SPLIT_K": split, "ALIGN_M": block_m, "enable_fp_fusion": False,
              **launch_options(dev)}  # fmt: skip
    if not hidden_fp4 or NI % 16:  # (an FP4 width that is not a multiple of 16 gets `quantize`'s error below)
        h = torch.empty(P, NI, dtype=torch.float32, device=dev)
        _silu_mul_kernel[(P // block_m, triton.cdiv(NI, 128))](
            part, xg, wgug, h, h, h, h, sorted_ids, expert_ids, num_slots, top_k, NI, P,
            QUANT=False, WRITE_BITS=False, BLOCK_M=block_m, BLOCK_N=128, num_warps=4, **common,
        )  # fmt: skip
        return _quantize_hidden(h, sorted_ids, num_slots, return_hidden) if hidden_fp4 else (h, None)
    packed = torch.empty(P, NI // 2, dtype=torch.uint8, device=dev)
    scale = torch.empty(P, NI // 16, dtype=torch.uint8, device=dev)
    g = torch.empty(P, 1, dtype=torch.float32, device=dev)
    bits = torch.empty(P, NI // 8, dtype=torch.uint8, device=dev) if return_hidden else packed
    rows = HIDDEN_LAUNCH["rows"] if block_m % HIDDEN_LAUNCH["rows"] == 0 else block_m
    width = triton.next_power_of_2(NI)
    warps = min(32, max(1, rows * width // (32 * HIDDEN_LAUNCH["values_per_thread"])))
    _silu_mul_kernel[(P // rows,)](
        part, xg, wgug, packed, scale, g, bits, sorted_ids, expert_ids, num_slots, top_k, NI, P,
        QUANT=True, WRITE_BITS=return_hidden, BLOCK_M=rows, BLOCK_N=width, num_warps=warps, **common,
    )  # fmt: skip
    hq = FP4Tensor(packed, scale, g, "nvfp4")
    if not return_hidden:
        return hq, None
    return hq, QuantizedHidden(hq, fp4.FP4Hints(bits, scale, g, "nvfp4"), sorted_ids, num_slots)


def _fused_hidden(cfg, off, P, NI, block_t, block_n, device) -> tuple[dict, tuple]:
    """(launch arguments, grid) of a Gluon gate/up launch: with the entry's ``fused_hidden``, unless ``off`` (hints
    asked for, which the fused quantization does not record; split-K partial sums) the kernel also quantizes the hidden activation (`gluon_common.quantize_token_block`), its outputs
    allocated here, on a (column tiles, token blocks) grid; else nothing and the (token blocks, column tiles) grid."""
    if not cfg.get("fused_hidden") or off:
        return {}, (P // block_t, NI // block_n)
    args = {
        "FUSED_HIDDEN": True,
        "hq_ptr": torch.empty(P, NI // 2, dtype=torch.uint8, device=device),
        "hs_ptr": torch.empty(P, NI // 16, dtype=torch.uint8, device=device),
        "hg_ptr": torch.empty(P, 1, dtype=torch.float32, device=device),
        "cnt_ptr": torch.zeros(P // block_t, dtype=torch.int32, device=device),
    }
    return args, (NI // block_n, P // block_t)


def _quantize_hidden(h, sorted_ids, num_slots, return_hidden):
    """The hidden activation [P, I] quantized per row as ``fp4.quantize(h, "nvfp4", "row")``, and its
    `QuantizedHidden` (codes with hints, in sorted order) when ``return_hidden``, else None. Without it the
    padding rows are skipped (uninitialized), as in the fused quantization: only the down kernel reads them, for
    outputs it drops. With it every row is quantized."""
    if not return_hidden:
        return fp4_quant.quantize(h, "nvfp4", "row", row_ids=sorted_ids, pad_id=num_slots), None
    hq, hints = fp4_quant.quantize(h, "nvfp4", "row", return_hints=True)
    return hq, QuantizedHidden(hq, hints, sorted_ids, num_slots)


def _experts_hopper(cfg, x, xs, xg, topk_weights, wgu, wgus, wgug, wd, wds, wdg, sorted_ids, expert_ids, M, K, H, NI,
                    return_hidden):  # fmt: skip
    """`experts_from_quantized` through the Gluon kernels (W4A4, sm_90+): same steps, same outputs."""
    from trace_hf.kernels import fp4_moe_hopper as hop

    n, bt, nw, bk = M * K, cfg["block_t"], cfg["num_warps"], cfg["block_k"]
    P = sorted_ids.numel()
    split = cfg.get("split_k", 1)
    while split > 1 and H % (split * bk):
        split //= 2
    part = _gate_up_out(split, P, NI, x.device)
    stages = check_hopper_entry(cfg)
    cap, cap_down = cfg.get("maxnreg"), cfg.get("maxnreg_down") or cfg.get("maxnreg")
    regs, regs_down = ({"maxnreg": c} if c else {} for c in (cap, cap_down))
    fused, grid = _fused_hidden(cfg, return_hidden or split > 1, P, NI, bt, cfg["block_n_gate_up"], x.device)
    hop.gate_up_kernel[grid + (split,)](
        x, xs, xg, wgu, wgus, wgug, part, sorted_ids, expert_ids, n, K, H, NI,
        SPLIT_K=split, BLOCK_T=bt, BLOCK_N=cfg["block_n_gate_up"], BLOCK_K=bk, NUM_WARPS=nw,
        X_SHARED=cfg.get("x_shared", False), STAGES=stages, num_warps=nw,
        **fused, **regs, **launch_options(x.device),
    )  # fmt: skip
    if fused:
        hq, hidden = FP4Tensor(fused["hq_ptr"], fused["hs_ptr"], fused["hg_ptr"], "nvfp4"), None
    else:
        hq, hidden = _hidden(part, xg, wgug, sorted_ids, expert_ids, n, K, bt, True, True, True, return_hidden)
    split_down = cfg.get("split_k_down", 1)
    while split_down > 1 and NI % (split_down * bk):
        split_down -= 1
    y = torch.empty(M, K * split_down, H, dtype=torch.float32, device=x.device)  # each slot's partial sums in a row
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    hop.down_kernel[(P // bt, H // cfg["block_n_down"], split_down)](
        hq.packed, hq.block_scale, hq.global_scale.reshape(-1), wd, wds, wdg, tw, y, sorted_ids, expert_ids, n, H, NI,
        SPLIT_K=split_down, BLOCK_T=bt, BLOCK_N=cfg["block_n_down"], BLOCK_K=bk, NUM_WARPS=nw,
        X_SHARED=cfg.get("x_shared", False), STAGES=stages, EARLY_WEIGHTS=int(cfg.get("early_weights", 0)),
        num_warps=nw, **regs_down, **launch_options(x.device),
    )  # fmt: skip
    return y, hidden


def _experts_wgmma(cfg, x, xs, xg, topk_weights, wgu, wgus, wgug, wd, wds, wdg, sorted_ids, expert_ids, M, K, H, NI,
                   return_hidden):  # fmt: skip
    """`experts_from_quantized` through the wgmma kernels of `fp4_moe_wgmma` (W4A4, sm_90+, many tokens per
    expert): same steps, same outputs as `_experts_hopper`."""
    from trace_hf.kernels import fp4_moe_wgmma as wg

    n, bt, nw, bk = M * K, cfg["block_t"], cfg["num_warps"], cfg["block_k"]
    slices = bool(cfg.get("slice_buffers", False))
    cap = gate_up_cap(cfg, n, wgu.shape[0], NI, x.device)
    regs, regs_down = ({"maxnreg": c} if c else {} for c in (cap, cfg.get("maxnreg_down") or cap))
    P = sorted_ids.numel()
    h = _gate_up_out(1, P, NI, x.device)
    fused, grid = _fused_hidden(cfg, return_hidden, P, NI, bt, cfg["block_n_gate_up"], x.device)
    wg.gate_up_kernel[grid](
        x, xs, xg, wgu, wgus, wgug, h, sorted_ids, expert_ids, n, K, H, NI,
        BLOCK_T=bt, BLOCK_N=cfg["block_n_gate_up"], BLOCK_K=bk, NUM_WARPS=nw, SLICE_BUFFERS=slices,
        GATE_FIRST=bool(cfg.get("gate_first", False)), num_warps=nw, **fused, **regs, **launch_options(x.device),
    )  # fmt: skip
    if fused:
        hq, hidden = FP4Tensor(fused["hq_ptr"], fused["hs_ptr"], fused["hg_ptr"], "nvfp4"), None
    else:
        hq, hidden = _hidden(h, xg, wgug, sorted_ids, expert_ids, n, K, bt, True, True, True, return_hidden)
    y = torch.empty(M, K, H, dtype=torch.float32, device=x.device)
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    wg.down_kernel[(P // bt, H // cfg["block_n_down"])](
        hq.packed, hq.block_scale, hq.global_scale.reshape(-1), wd, wds, wdg, tw, y, sorted_ids, expert_ids, n, H, NI,
        BLOCK_T=bt, BLOCK_N=cfg["block_n_down"], BLOCK_K=bk, NUM_WARPS=nw, SLICE_BUFFERS=slices,
        num_warps=nw, **regs_down, **launch_options(x.device),
    )  # fmt: skip
    return y, hidden


def _experts_grouped(cfg, xq, topk_ids, topk_weights, w_gate_up, w_down, align_backend, return_hidden, reduce,
                     bf16_sums):  # fmt: skip
    """`experts_from_quantized` for W4A4 with many tokens per expert (`GROUPED`): the weights, the input and the
    hidden are decoded to bf16 as ``E2M1 * s`` (exact), once per call, and multiplied over `moe_align`'s segments; the
    global scales, SiLU * up, the hidden's quantization (and hints) and the routing weights are the other kernels'
    epilogues. ``bf16_sums``: torch's grouped GEMM, whose sums are rounded to bf16 (a relative 2^-9) before the fp32
    epilogues; else `_grouped_gemm_kernel`, fp32 sums as the other kernels (``GROUPED["fp32_sums"]``)."""
    if not bf16_sums:
        return _experts_grouped_fp32(cfg, xq, topk_ids, topk_weights, w_gate_up, w_down, align_backend, return_hidden)
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
    hq, hidden = _hidden(gate_up[None], xg, wgug, sorted_ids, expert_ids, n, K, bm, True, True, True, return_hidden)
    del gate_up
    h = _exact_bf16(hq.packed, hq.block_scale, dr)
    out = _grouped_mm(h, _exact_bf16(w_down.packed, w_down.block_scale, dr), offsets)
    del h
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    wdg = w_down.global_scale.reshape(-1).float().contiguous()
    y = torch.empty((M, H) if reduce else (M, K, H), dtype=torch.float32, device=out.device)
    _grouped_combine_kernel[(triton.cdiv(M, 16), triton.cdiv(H, 128))](
        out, hq.global_scale.reshape(-1), wdg, tw, topk_ids.reshape(-1), _slot_rows(sorted_ids, n), y, M, H,
        K=K, REDUCE=reduce, BLOCK_T=16, BLOCK_N=128, num_warps=4,
    )  # fmt: skip
    return y, hidden


def _experts_grouped_fp32(cfg, xq, topk_ids, topk_weights, w_gate_up, w_down, align_backend, return_hidden):
    """The grouped path with fp32 GEMM sums (`_grouped_gemm_kernel`): the function of the wgmma kernels, and their
    outputs' layout, the weighted slots side by side [M, K, H], which the caller sums as it sums theirs (so a training
    forward, which sums outside, gets the bits of the eval forward). The input is decoded once per token (the kernel
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
    hq, hidden = _hidden(h, xg, wgug, sorted_ids, expert_ids, n, K, bm, True, True, True, return_hidden)
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
    block_k = _pick(K, 256)
    _decode_rows_kernel[(triton.cdiv(R, rows), K // block_k)](
        packed, block_scale, out, R, K, ROWS=rows, BLOCK_K=block_k, num_warps=4
    )
    return out


def _grouped_mm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of ``a`` (segments ending at ``offsets``) times ``w[e].T`` (``w`` [E, N, K]), bf16."""
    mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return mm(a, w.transpose(-2, -1), offs=offsets)


def fp4_moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: FP4Tensor,
    w_down: FP4Tensor,
    activations: str = "fp4",
    return_hints: bool = False,
):
    """`TraceFP4Experts`' eval path in Triton: ``x`` [M, H] -> [M, H] in ``x.dtype``.

    ``activations="fp4"`` quantizes the input per token and the hidden per (token, expert) row (W4A4);
    ``"none"`` keeps them dense (W4A16). With ``return_hints`` also returns the input's `FP4Hints` (written in the
    quantization pass), what `trace_hf.hints.HintRecorder` keeps.
    """
    hints = None
    if activations == "fp4":
        if return_hints:
            xq, hints = fp4_quant.quantize(x, "nvfp4", "row", return_hints=True)
        else:
            xq = fp4_quant.quantize(x, "nvfp4", "row")
    elif activations == "none":
        xq = x
    else:
        raise ValueError(f"activations={activations!r}: use 'fp4' or 'none'.")
    y = experts_from_quantized(xq, topk_ids, topk_weights, w_gate_up, w_down, hidden_fp4=activations == "fp4")
    out = y.sum(1).to(x.dtype)
    return (out, hints) if return_hints else out


def moe_experts_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: FP4Tensor | torch.Tensor,
    w_down: FP4Tensor | torch.Tensor,
    activations: str = "fp4",
    gemm_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The torch fallback and reference: the math of `TraceFP4Experts._routed` (eval path), computed in fp32 by
    gathering each slot's expert weights (fine for tests and small batches, not fast). As in the kernels, a GEMM
    sums ``E2M1 * s`` products and its operands' global scales multiply the sum: the function of every kernel path
    with fp32 sums (the grouped one with ``GROUPED["fp32_sums"]`` included). ``gemm_dtype=torch.bfloat16``: each
    GEMM's sum is rounded to bf16 before the scales, the function of the grouped path with ``bf16_sums=True``."""
    xf = x.float()
    xg = 1.0
    if activations == "fp4":
        xf, xg = _exact_and_global(fp4.quantize(xf, "nvfp4", "row", backend="torch"))
    gu, gug = _exact_and_global(w_gate_up)
    d, dg = _exact_and_global(w_down)
    M, K = topk_ids.shape
    out = torch.zeros(M, x.shape[-1], dtype=torch.float32, device=x.device)
    for k in range(K):
        e = topk_ids[:, k].long()
        gate, up = (_round(torch.einsum("mh,mnh->mn", xf, gu[e]), gemm_dtype) * xg * gug[e]).chunk(2, dim=-1)
        h, hg = torch.nn.functional.silu(gate) * up, 1.0
        if activations == "fp4":
            h, hg = _exact_and_global(fp4.quantize(h, "nvfp4", "row", backend="torch"))
        out += _round(torch.einsum("mi,mhi->mh", h, d[e]), gemm_dtype) * hg * dg[e] * topk_weights[:, k, None].float()
    return out.to(x.dtype)


def _exact_and_global(q: FP4Tensor | torch.Tensor):
    """(``E2M1 * s`` in fp32, the global scale shaped to multiply a GEMM's output rows) of an `FP4Tensor`: an
    activation [M, K] gives [M, 1], expert weights [E, N, K] give [E, 1] (indexed by expert); (fp32, 1) if dense."""
    if not isinstance(q, FP4Tensor):
        return q.float(), torch.ones(q.shape[0], 1, device=q.device) if q.ndim == 3 else 1.0
    ones = torch.ones(q.packed.shape[:-1] + (1,), dtype=torch.float32, device=q.packed.device)
    exact = FP4Tensor(q.packed, q.block_scale, ones, q.fmt).dequantize()
    return exact, q.global_scale.float().reshape(q.shape[0], 1)


def _round(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None else t.to(dtype).float()
