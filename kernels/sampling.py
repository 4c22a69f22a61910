# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Gumbel-max sampling from processed logits with counter-based noise, for the rollout engine's decode step.

A draw is ``argmax_v(x_v + G_v)`` with ``G_v = -log(-log(u_v))`` and ``u_v`` Philox noise (`tl.rand`) keyed by
(seed + step * 1000003, row * V + v): the same (seed, step) always gives the same tokens, nothing holds generator
state, and the seed and step are read from device memory, so a captured CUDA graph replays with fresh draws. ``row``
is the row of ``x`` unless ``rows`` names each row's own (the rollout engine's compaction moves a sequence to
another row of the batch; its draws stay those of its own row). On the GPU one program per row streams the row once
(the logits are read once, no sort, no softmax).
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.sampling (see kernels/README.md), not kernels.sampling.")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trace_hf.kernels.common import check_device  # noqa: E402


@triton.jit
def _gumbel_argmax_kernel(x_ptr, out_ptr, seed_ptr, step_ptr, ids_ptr, B, V, stride, ROWS: tl.constexpr,
                          BLOCK: tl.constexpr, HAS_IDS: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < B
    key = tl.load(ids_ptr + rows, mask=row_ok, other=0).to(tl.int32) if HAS_IDS else rows
    seed = tl.load(seed_ptr) + tl.load(step_ptr) * 1000003
    best_v = tl.full([ROWS, BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([ROWS, BLOCK], dtype=tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = row_ok[:, None] & (offs < V)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride + offs[None, :], mask=ok, other=float("-inf"))
        u = tl.rand(seed, key[:, None] * V + offs[None, :])
        y = x - tl.log(-tl.log(u))  # u == 0 gives -inf: never drawn
        take = ok & (y > best_v)
        best_v = tl.where(take, y, best_v)
        best_i = tl.where(take, offs[None, :], best_i)
    top = tl.max(best_v, 1)
    idx = tl.min(tl.where(best_v == top[:, None], best_i, V), 1)  # ties (measure zero): the lowest id
    tl.store(out_ptr + rows, idx.to(tl.int64), mask=row_ok)


def gumbel_argmax(x: torch.Tensor, seed: torch.Tensor, step: torch.Tensor, out: torch.Tensor | None = None,
                  rows: torch.Tensor | None = None):  # fmt: skip
    """Token ids int64 [B] drawn from ``softmax(x)`` (``x`` fp32 [B, V], -inf for excluded tokens); ``seed`` and
    ``step`` are int64 device tensors of one element. ``rows`` (int64 [B], each in [0, B'), with B' * V < 2^31): the
    row whose noise each row of ``x`` draws with (default: its own)."""
    check_device(x)
    if x.dtype != torch.float32 or x.ndim != 2:
        raise ValueError(f"gumbel_argmax takes fp32 [B, V] logits, got {x.dtype} {tuple(x.shape)}.")
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, V = x.shape
    if B * V >= 2**31:
        raise ValueError(f"gumbel_argmax: batch x vocab = {B * V} exceeds the 2^31 noise counter; draw in chunks.")
    if rows is not None and (rows.shape != (B,) or rows.dtype != torch.int64):
        raise ValueError(f"gumbel_argmax: rows must be int64 [{B}], got {rows.dtype} {tuple(rows.shape)}.")
    out = torch.empty(B, dtype=torch.int64, device=x.device) if out is None else out
    block = min(4096, triton.next_power_of_2(V))
    # One row per program on the GPU (rows in parallel); the interpreter runs programs one after another, so
    # there a program takes many rows. The draws do not depend on the tiling.
    per = 1 if x.is_cuda else max(1, min(triton.next_power_of_2(B), 8192 // block))
    ids = out if rows is None else rows.contiguous()  # not read without rows
    _gumbel_argmax_kernel[(triton.cdiv(B, per),)](x, out, seed, step, ids, B, V, x.stride(0), ROWS=per, BLOCK=block,
                                                  HAS_IDS=rows is not None, num_warps=8)  # fmt: skip
    return out
