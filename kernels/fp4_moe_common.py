# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""What the routed experts' backends (`fp4_moe_triton`, `fp4_moe_hopper`, `fp4_moe_wgmma`, `fp4_moe_grouped`)
share, one definition each: the Triton pieces of their GEMMs and epilogues (`dot_nt`, `row_block`,
`silu_mul_store`), the hidden activation between the two GEMMs (step 4 of `fp4_moe`'s pipeline: `down_input`,
`fused_hidden`, `QuantizedHidden`) and the operands as the kernels read them (`fp4_args`).

Why a module of its own: every backend computes the same steps around its GEMMs, and `fp4_moe`, which picks the
backend, imports them all; the backends import from here and export nothing to each other.
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.fp4_moe_common (see kernels/README.md), not kernels.fp4_moe_common.")

from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trace_hf import fp4  # noqa: E402
from trace_hf.fp4 import FP4Tensor  # noqa: E402
from trace_hf.kernels import fp4_quant  # noqa: E402
from trace_hf.kernels.fp4_moe_configs import HIDDEN_LAUNCH  # noqa: E402
from trace_hf.kernels.pdl import launch_options, wait_for_producer  # noqa: E402


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def dot_nt(a, b, acc, DOT_BF16: tl.constexpr, PTX: tl.constexpr = False):
    """acc + a @ b.T with fp32 accumulation (bf16 operands on the GPU, exact fp32 in the interpreter; with ``PTX``
    the fp16 tiles of `fp4_halves_f16` as they are)."""
    if PTX:
        return tl.dot(a, tl.trans(b), acc)
    elif DOT_BF16:
        return tl.dot(a.to(tl.bfloat16), tl.trans(b.to(tl.bfloat16)), acc)
    else:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")


@triton.jit
def row_block(sorted_ptr, pid_m, num_slots, BLOCK_M: tl.constexpr):
    """Sorted positions of row block ``pid_m``, their slots, and which are real (not padding)."""
    offs_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ptr + offs_p)
    return offs_p, slot, slot < num_slots


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
def silu_mul_store(acc_g, acc_u, ag_ptr, wg_ptr, h_ptr, e, row, valid, offs_p, offs_n, n_ok, NI,
                    A_FP4: tl.constexpr, W_FP4: tl.constexpr):  # fmt: skip
    """The gate/up epilogue, stored by sorted position."""
    h = _silu_mul(acc_g, acc_u, ag_ptr, wg_ptr, e, row[:, None], valid[:, None], A_FP4, W_FP4)
    tl.store(h_ptr + offs_p.to(tl.int64)[:, None] * NI + offs_n[None, :], h, mask=n_ok[None, :])


@triton.jit(do_not_specialize=["num_slots", "P"])  # token counts: see kernels/README.md
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
    offs_p, slot, valid = row_block(sorted_ptr, pid_m, num_slots, BLOCK_M)
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
        silu_mul_store(acc_g, acc_u, ag_ptr, wg_ptr, h_ptr, e, row, valid, offs_p, offs_n, n_ok, NI, A_FP4, W_FP4)


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------


def pick(n: int, preferred: int) -> int:
    """Largest power of two <= preferred that divides n (at least 16: NVFP4 blocks, tl.dot minimum)."""
    b = preferred
    while b > 16 and n % b:
        b //= 2
    if n % b:
        raise ValueError(f"Dimension {n} is not a multiple of 16.")
    return b


def is_fp4(q: FP4Tensor | torch.Tensor) -> bool:
    """Whether ``q`` is packed (an NVFP4 `FP4Tensor`) rather than dense; other FP4 formats are refused."""
    if isinstance(q, FP4Tensor):
        if q.fmt != "nvfp4":
            raise ValueError(f"The FP4 MoE kernels take NVFP4 tensors, got {q.fmt}.")
        return True
    return False


def fp4_args(q: FP4Tensor | torch.Tensor):
    """(values or codes, block scales, global scales, whether packed) as the kernels read them; dense tensors get
    dummies."""
    if is_fp4(q):
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
        return slot_rows(self.slots, self.num_slots)


def slot_rows(sorted_ids: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The sorted position of every slot, [num_slots] int64, from `moe_align`'s ``sorted_ids`` (no host sync)."""
    pos = torch.zeros(num_slots + 1, dtype=torch.int64, device=sorted_ids.device)
    rows = torch.arange(sorted_ids.numel(), device=sorted_ids.device)
    return pos.scatter_(0, sorted_ids.long(), rows)[:num_slots]  # padding rows all land on the extra one


def gate_up_out(split: int, P: int, NI: int, device) -> torch.Tensor:
    """What the gate/up kernels write: the hidden activation fp32 [P, I], or with split-K the partial gate and up
    sums fp32 [split, P, 2I] (padding rows left unwritten)."""
    shape = (P, NI) if split == 1 else (split, P, 2 * NI)
    return torch.empty(shape, dtype=torch.float32, device=device)


def down_input(part, xg, wgug, sorted_ids, expert_ids, num_slots, top_k, block_m, a_fp4, w_fp4, hidden_fp4,
            return_hidden):  # fmt: skip
    """The down projection's input from the gate/up output ``part`` (`gate_up_out`): the hidden activation,
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


def fused_hidden(cfg, off, P, NI, block_t, block_n, device) -> tuple[dict, tuple]:
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
