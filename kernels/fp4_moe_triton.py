# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The routed experts' portable backend: Triton kernels for every GPU and the interpreter, with packed NVFP4 or
dense BF16 weights and activations (`fp4_moe`'s pipeline, steps 3 and 5).

Why: the Gluon kernels (`fp4_moe_hopper`, `fp4_moe_wgmma`) need sm_90+, W4A4 and tiles that divide the shapes; these
run every other call: W4A16, the BF16 baseline, older GPUs (interleaved tiles with integer decoding where
`common.hardware_fp8` is off), the interpreter (CI's bit-exact tests against the torch reference).
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.fp4_moe_triton (see kernels/README.md), not kernels.fp4_moe_triton.")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trace_hf.kernels.common import DOT_BF16, INTERPRETED, load_fp4_rows, load_halves  # noqa: E402
from trace_hf.kernels.fp4_moe_common import (  # noqa: E402
    dot_nt,
    down_input,
    fp4_args,
    gate_up_out,
    pick,
    row_block,
    silu_mul_store,
)
from trace_hf.kernels.moe_align import moe_align  # noqa: E402
from trace_hf.kernels.pdl import launch_options, wait_for_producer  # noqa: E402


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _load_rows(ptr, q_s_ptr, rows, row_mask, k0, K, FP4: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    if FP4:
        return load_fp4_rows(ptr, q_s_ptr, rows, row_mask, k0, K, ROWS, BLOCK_K)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)[None, :]
        return tl.load(ptr + rows.to(tl.int64)[:, None] * K + kk, mask=row_mask[:, None], other=0.0)


@triton.jit(do_not_specialize=["num_slots"])  # token counts: see kernels/README.md
def _gate_up_kernel(
    a_ptr,  # x: packed [M, H/2] (A_FP4) or dense [M, H]
    as_ptr,  # x block scales [M, H/16] (A_FP4)
    ag_ptr,  # x row scales [M] fp32 (A_FP4)
    w_ptr,  # W_gate_up: packed [E, 2I, H/2] (W_FP4) or dense [E, 2I, H]
    ws_ptr,  # [E, 2I, H/16]
    wg_ptr,  # [E] fp32
    h_ptr,  # out: SiLU(gate) * up, fp32 [P, I] by sorted position; with SPLIT_K > 1 the raw partial sums of
    # gate and up, fp32 [SPLIT_K, P, 2I], that `fp4_moe_common.down_input` finishes
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
    offs_p, slot, valid = row_block(sorted_ptr, pid_m, num_slots, BLOCK_M)
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
            acc_g = dot_nt(a1, g1, dot_nt(a0, g0, acc_g, DOT_BF16, PTX), DOT_BF16, PTX)
            acc_u = dot_nt(a1, u1, dot_nt(a0, u0, acc_u, DOT_BF16, PTX), DOT_BF16, PTX)
        else:
            a = _load_rows(a_ptr, as_ptr, row, valid, k0, H, A_FP4, BLOCK_M, BLOCK_K)
            wg = _load_rows(w_ptr, ws_ptr, gate_rows, n_ok, k0, H, W_FP4, BLOCK_N, BLOCK_K)
            wu = _load_rows(w_ptr, ws_ptr, up_rows, n_ok, k0, H, W_FP4, BLOCK_N, BLOCK_K)
            acc_g = dot_nt(a, wg, acc_g, DOT_BF16)
            acc_u = dot_nt(a, wu, acc_u, DOT_BF16)
    if PTX:  # both operands carried 2^-14
        acc_g = acc_g * 268435456.0
        acc_u = acc_u * 268435456.0
    if SPLIT_K == 1:
        silu_mul_store(acc_g, acc_u, ag_ptr, wg_ptr, h_ptr, e, row, valid, offs_p, offs_n, n_ok, NI, A_FP4, W_FP4)
    else:
        part = (
            h_ptr + (pid_k * tl.num_programs(0) * BLOCK_M + offs_p).to(tl.int64)[:, None] * (2 * NI) + offs_n[None, :]
        )
        # Padding rows are not stored: `fp4_moe_common.down_input` does not read them.
        keep = valid[:, None] & n_ok[None, :]
        tl.store(part, acc_g, mask=keep)
        tl.store(part + NI, acc_u, mask=keep)


@triton.jit(do_not_specialize=["num_slots"])  # token counts: see kernels/README.md
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
    offs_p, slot, valid = row_block(sorted_ptr, pid_m, num_slots, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    w_rows = e.to(tl.int64) * H + offs_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, NI, BLOCK_K):
        if HALVES:
            a0, a1 = load_halves(a_ptr, as_ptr, offs_p, valid, k0, NI, A_FP4, BLOCK_K, PTX)
            w0, w1 = load_halves(w_ptr, ws_ptr, w_rows, n_ok, k0, NI, W_FP4, BLOCK_K, PTX)
            acc = dot_nt(a1, w1, dot_nt(a0, w0, acc, DOT_BF16, PTX), DOT_BF16, PTX)
        else:
            a = _load_rows(a_ptr, as_ptr, offs_p, valid, k0, NI, A_FP4, BLOCK_M, BLOCK_K)
            w = _load_rows(w_ptr, ws_ptr, w_rows, n_ok, k0, NI, W_FP4, BLOCK_N, BLOCK_K)
            acc = dot_nt(a, w, acc, DOT_BF16)
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


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------


def _ptx(cfg: dict, a_fp4: bool, w_fp4: bool) -> bool:
    """Whether a GEMM decodes with `fp4_halves_f16`: both operands packed FP4 (fp16 cannot hold bf16 activations
    exactly), halves layout, on the GPU (the interpreter runs no PTX)."""
    return bool(cfg.get("ptx")) and cfg["halves"] and a_fp4 and w_fp4 and not INTERPRETED


def experts(cfg, block_m, xq, topk_ids, topk_weights, w_gate_up, w_down, hidden_fp4, align_backend, return_hidden):
    """`fp4_moe.experts_from_quantized` through the Triton kernels with the launch config ``cfg`` (its operand
    decoding already set for the device) and ``block_m`` rows per expert block: (y [M, K, H], `QuantizedHidden` or
    None). ``xq`` and the weights: `FP4Tensor` or dense."""
    x_arg, xs, xg, a_fp4 = fp4_args(xq)
    wgu, wgus, wgug, w_fp4 = fp4_args(w_gate_up)
    wd, wds, wdg, _ = fp4_args(w_down)
    E, H, NI = w_gate_up.shape[0], w_gate_up.shape[2], w_gate_up.shape[1] // 2
    M, K = topk_ids.shape
    n, bm, dev = M * K, block_m, x_arg.device
    sorted_ids, expert_ids = moe_align(topk_ids, E, bm, align_backend)
    P = sorted_ids.numel()
    bk_h, bk_i = pick(H, cfg["block_k"]), pick(NI, cfg["block_k"])
    bn_gu, bn_d = cfg["block_n_gate_up"], cfg["block_n_down"]
    common = {
        "DOT_BF16": DOT_BF16,
        "BLOCK_M": bm,
        "num_warps": cfg["num_warps"],
        "num_stages": cfg["num_stages"],
        "enable_fp_fusion": True,
        # BF16 weights: no PDL (decode at batch 1 ran 9% slower with it, docs/lab-notes.md).
        **(launch_options(dev) if w_fp4 else {"PDL": False}),
    }
    split = cfg.get("split_k", 1)
    while split > 1 and H % (split * bk_h):  # a launch knob: fewer splits where the K tiles do not divide evenly
        split //= 2
    part = gate_up_out(split, P, NI, dev)
    _gate_up_kernel[(P // bm, triton.cdiv(NI, bn_gu), split)](
        x_arg, xs, xg, wgu, wgus, wgug, part, sorted_ids, expert_ids, n, K, H, NI,
        A_FP4=a_fp4, W_FP4=w_fp4, HALVES=cfg["halves"] and (a_fp4 or w_fp4), PTX=_ptx(cfg, a_fp4, w_fp4),
        SPLIT_K=split, BLOCK_N=bn_gu, BLOCK_K=bk_h, **common,
    )  # fmt: skip
    hq, hidden = down_input(part, xg, wgug, sorted_ids, expert_ids, n, K, bm, a_fp4, w_fp4, hidden_fp4, return_hidden)
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
