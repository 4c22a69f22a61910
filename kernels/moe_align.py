# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Expert alignment for the routed-experts GEMMs: (token, slot) pairs sorted by expert, each expert's segment padded
to whole row blocks (as vLLM's ``moe_align_block_size``), so that every row block of a GEMM belongs to one expert.
Static shapes and no host sync, so that a CUDA graph can capture it."""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.moe_align (see kernels/README.md), not kernels.moe_align.")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trace_hf.kernels.fp4_moe_configs import ALIGN, CONFIG  # noqa: E402
from trace_hf.kernels.pdl import launch_options, wait_for_producer  # noqa: E402


@triton.jit(do_not_specialize=["N", "num_blocks"])  # token counts: see kernels/README.md
def _align_kernel(
    ids_ptr,  # [N] int32 expert id of each slot
    sorted_ptr,  # out [P] int32
    expert_ptr,  # out [P / BLOCK_M] int32
    N,
    E,
    num_blocks,
    BLOCK_M: tl.constexpr,
    N_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``e < E`` places expert e's slots (in slot order) and its padding; program ``E`` marks the row
    blocks past the last segment with expert -1 and fills their rows with the sentinel N. Every program recounts
    all experts (one histogram of N ids: N is a decode batch, a few thousand slots at most)."""
    wait_for_producer(PDL)
    e = tl.program_id(0)
    offs = tl.arange(0, N_PAD)
    ids = tl.load(ids_ptr + offs, mask=offs < N, other=E)  # padding lands in bin E (E_PAD > E), dropped below
    ex = tl.arange(0, E_PAD)
    counts = tl.where(ex < E, tl.histogram(ids, E_PAD), 0)  # [E_PAD]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    if e < E:
        end = tl.sum(tl.where(ex == e, ends, 0), axis=0)
        pad_e = tl.sum(tl.where(ex == e, padded, 0), axis=0)
        cnt = tl.sum(tl.where(ex == e, counts, 0), axis=0)
        start = end - pad_e
        mine = ids == e
        rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1
        tl.store(sorted_ptr + start + rank, offs, mask=mine)
        j = tl.arange(0, BLOCK_M)
        # Padding rows of the segment (cnt .. pad_e) get the sentinel N; row blocks of the segment get e.
        for p0 in range(0, pad_e, BLOCK_M):
            pos = p0 + j
            tl.store(sorted_ptr + start + pos, tl.full([BLOCK_M], 0, tl.int32) + N, mask=pos >= cnt)
            tl.store(expert_ptr + (start + p0) // BLOCK_M, e)
    else:
        for b0 in range(total // BLOCK_M, num_blocks, BLOCK_M):
            b = b0 + tl.arange(0, BLOCK_M)
            tl.store(expert_ptr + b, tl.full([BLOCK_M], -1, tl.int32), mask=b < num_blocks)
        # Their rows hold the sentinel too: every entry is defined (`QuantizedHidden.positions` scatters them all).
        j = tl.arange(0, BLOCK_M)
        for r0 in range(total, num_blocks * BLOCK_M, BLOCK_M):
            tl.store(sorted_ptr + r0 + j, tl.full([BLOCK_M], 0, tl.int32) + N)


@triton.jit(do_not_specialize=["N"])  # token counts: see kernels/README.md
def _chunk_count_kernel(ids_ptr, counts_ptr, N, E, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """Row c of ``counts`` [C, E_PAD]: how many slots of chunk c (slots c * CHUNK ..) each expert has (bin E and
    above: the chunk's padding past N)."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < N, other=E).to(tl.int32)
    tl.store(counts_ptr + c * E_PAD + tl.arange(0, E_PAD), tl.histogram(ids, E_PAD))


@triton.jit(do_not_specialize=["C", "num_blocks"])  # token counts: see kernels/README.md
def _chunk_scan_kernel(
    counts_ptr,  # [C, E_PAD] int32 (`_chunk_count_kernel`); out: the first row of each (chunk, expert) in place
    expert_ptr,  # out [num_blocks] int32
    C,
    E,
    num_blocks,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """One program: each expert's total and padded segment, then for every chunk the row where its first slot of
    each expert goes (the segment's start plus that expert's slots in the chunks before), and the expert of every
    row block (-1 past the last segment), as the torch backend's ``searchsorted``."""
    ex = tl.arange(0, E_PAD)
    r = tl.arange(0, ROWS)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, C, ROWS):
        ok = (c0 + r < C)[:, None]
        total += tl.sum(tl.load(counts_ptr + (c0 + r)[:, None] * E_PAD + ex[None, :], mask=ok, other=0), axis=0)
    padded = tl.where(ex < E, (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, axis=0)
    run = ends - padded
    for c0 in range(0, C, ROWS):
        ok = (c0 + r < C)[:, None]
        ptrs = counts_ptr + (c0 + r)[:, None] * E_PAD + ex[None, :]
        cnt = tl.load(ptrs, mask=ok, other=0)
        tl.store(ptrs, run[None, :] + tl.cumsum(cnt, axis=0) - cnt, mask=ok)
        run += tl.sum(cnt, axis=0)
    for b0 in range(0, num_blocks, BLOCKS):
        b = b0 + tl.arange(0, BLOCKS)
        e = tl.sum((ends[None, :] <= b[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(expert_ptr + b, tl.where(e < E, e, -1), mask=b < num_blocks)


@triton.jit(do_not_specialize=["N"])  # token counts: see kernels/README.md
def _chunk_place_kernel(
    ids_ptr,  # [N] expert of each slot
    first_ptr,  # [C, E_PAD] int32: `_chunk_scan_kernel`'s rows
    sorted_ptr,  # out [P] int32
    N,
    E,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    E_PAD: tl.constexpr,
    E_P2: tl.constexpr,
):
    """Chunk c's slots to their rows: ``first`` (`_chunk_scan_kernel`) plus the slot's rank among the chunk's slots
    of its expert, counted SUB slots at a time: the stable sort by expert, without sorting."""
    c = tl.program_id(0)
    ex = tl.arange(0, E_P2)
    nxt = tl.load(first_ptr + c * E_PAD + ex)  # the next free row of each expert
    for s0 in range(0, CHUNK, SUB):
        offs = c * CHUNK + s0 + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < N, other=E).to(tl.int32)
        mine = ids[:, None] == ex[None, :]
        hit = mine.to(tl.int32)
        row = tl.sum(tl.where(mine, tl.cumsum(hit, axis=0) - 1 + nxt[None, :], 0), axis=1)
        tl.store(sorted_ptr + row, offs, mask=offs < N)
        nxt += tl.sum(hit, axis=0)


#: Largest number of (token, slot) pairs the one-launch alignment kernel handles; above it, torch ops (or the
#: chunked kernels, where ``ALIGN["chunked"]`` is on).
ALIGN_KERNEL_MAX = 4096


def max_padded_rows(num_slots: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted, padded layout: every expert that is hit pads at most block_m - 1 rows; a static bound
    (no host sync), so that a CUDA graph can capture the layout."""
    rows = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int | None = None, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots (token * top_k + k) sorted by expert and padded per expert to ``block_m`` rows.

    Returns ``sorted_ids`` [P] int32 (padding holds ``num_slots``) and ``expert_ids`` [P / block_m] int32 (the
    expert of each row block, -1 for blocks past the last segment). Static shapes, no host sync.
    ``backend``: ``"triton"`` (one launch; up to `ALIGN_KERNEL_MAX` slots), ``"torch"``, ``"chunks"`` (any number
    of slots, the torch backend's bits, `_align_chunks`), or ``"auto"``, which for one token launches nothing: its
    top-k experts are distinct, so slot k gets row block k as it is (`_one_token_rows`; repeated ids would only
    repeat a block's weight reads); up to `ALIGN_KERNEL_MAX` slots on CUDA "triton", above it "chunks" where
    ``fp4_moe_configs.ALIGN["chunked"]`` is on, else "torch".
    """
    block_m = block_m or CONFIG["block_m"]
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    P = max_padded_rows(n, num_experts, block_m)
    dev = flat.device
    if backend == "auto" and topk_ids.shape[0] == 1 and n * block_m == P:
        return _one_token_rows(n, block_m, dev), flat.to(torch.int32)
    use_kernel = backend == "triton" or (backend == "auto" and n <= ALIGN_KERNEL_MAX and (dev.type == "cuda"))
    if backend == "chunks" or (backend == "auto" and not use_kernel and ALIGN["chunked"] and dev.type == "cuda"):
        return _align_chunks(flat, num_experts, block_m, P)
    if use_kernel:
        sorted_ids = torch.empty(P, dtype=torch.int32, device=dev)
        expert_ids = torch.empty(P // block_m, dtype=torch.int32, device=dev)
        _align_kernel[(num_experts + 1,)](
            flat.to(torch.int32), sorted_ids, expert_ids, n, num_experts, P // block_m,
            BLOCK_M=block_m, N_PAD=triton.next_power_of_2(max(n, 16)),
            E_PAD=triton.next_power_of_2(num_experts + 1), num_warps=4, enable_fp_fusion=True,
            **launch_options(dev),
        )  # fmt: skip
        return sorted_ids, expert_ids
    flat = flat.to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[sorted_e]
    dest = (ends - padded)[sorted_e] + rank
    sorted_ids = torch.full((P,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    blocks = torch.arange(0, P, block_m, device=dev)
    expert_ids = torch.searchsorted(ends, blocks, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids


def _align_chunks(flat: torch.Tensor, E: int, block_m: int, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_align`'s layout, the same bits as the torch backend's, in three launches over chunks of slots (counts,
    one program's scan, placement) after the fill: no radix sort (cub's sorts all 64 bits of the ids)."""
    n, dev, chunk = flat.numel(), flat.device, ALIGN["chunk"]
    C = max(1, triton.cdiv(n, chunk))
    e_pad = triton.next_power_of_2(E + 1)  # bin E: a chunk's padding past n
    sorted_ids = torch.full((P,), n, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(P // block_m, dtype=torch.int32, device=dev)
    counts = torch.empty(C, e_pad, dtype=torch.int32, device=dev)
    _chunk_count_kernel[(C,)](flat, counts, n, E, CHUNK=chunk, E_PAD=e_pad, num_warps=4, enable_fp_fusion=True)
    _chunk_scan_kernel[(1,)](
        counts, expert_ids, C, E, P // block_m, BLOCK_M=block_m, E_PAD=e_pad, ROWS=ALIGN["scan_rows"],
        BLOCKS=ALIGN["scan_rows"], num_warps=8, enable_fp_fusion=True,
    )  # fmt: skip
    _chunk_place_kernel[(C,)](
        flat, counts, sorted_ids, n, E, CHUNK=chunk, SUB=ALIGN["sub"], E_PAD=e_pad,
        E_P2=triton.next_power_of_2(E), num_warps=4, enable_fp_fusion=True,
    )  # fmt: skip
    return sorted_ids, expert_ids


_ONE_TOKEN_ROWS: dict = {}


def _one_token_rows(n: int, block_m: int, device: torch.device) -> torch.Tensor:
    """`moe_align`'s ``sorted_ids`` for one token: slot k at row ``k * block_m``, the rest padding. Kept per shape and
    device, made outside graph capture (the decode step's eager warm-up), so that a captured step launches nothing
    for it; under capture with nothing kept yet, built in the graph instead."""
    key = (n, block_m, device)
    rows = _ONE_TOKEN_ROWS.get(key)
    if rows is None:
        rows = torch.full((n, block_m), n, dtype=torch.int32, device=device)
        rows[:, 0] = torch.arange(n, dtype=torch.int32, device=device)
        rows = rows.reshape(-1)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _ONE_TOKEN_ROWS[key] = rows
    return rows
