# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Gumbel-max sampling with counter-based noise, and the drawn token's log-prob, for the rollout engine's decode step.

A draw is ``argmax_v(x_v + G_v)`` with ``G_v = -log(-log(u_v))`` and ``u_v`` Philox noise: output ``v % 4`` of
`tl.rand4x` at counter ``row * ceil(V / 4) + v // 4`` and key seed + step * 1000003. The draw is bound by its
arithmetic, not its bytes: one Philox evaluation per four tokens and one fast log make it 80 sm_90 instructions per
token, against 139 with one Philox evaluation per token and two accurate logs. The same (seed, step) always gives the
same tokens, nothing holds generator state, and the seed and step are read from device memory, so a captured CUDA
graph replays with fresh draws. ``row``
is the row of ``x`` unless ``rows`` names each row's own (the rollout engine's compaction moves a sequence to
another row of the batch; its draws stay those of its own row).

Two launches: one program per (row, vocabulary chunk) keeps the chunk's best draw and, for the log-prob, its max and
sum of exponentials; one program per row then combines the chunks. A decode step's hundreds of rows times ~75 chunks
fill the GPU, and the logits (any float dtype, e.g. the lm_head's bf16) are read once. The draw does not depend on
the chunking: ties (measure zero) go to the lowest id, NaN is never drawn.
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.sampling (see kernels/README.md), not kernels.sampling.")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra import libdevice  # noqa: E402

from trace_hf.kernels.common import INTERPRETED, check_device  # noqa: E402


CHUNK = 2048  # vocabulary entries per program of the first launch


@triton.jit
def _draw_chunks_kernel(x_ptr, y_ptr, i_ptr, m_ptr, s_ptr, seed_ptr, step_ptr, ids_ptr, inv_t, B, V, stride, C,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr, SCALE: tl.constexpr, HAS_IDS: tl.constexpr,
                        LOGPROB: tl.constexpr, FAST_LOG: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < B
    chunk = tl.program_id(1)
    key = tl.load(ids_ptr + rows, mask=row_ok, other=0).to(tl.int32) if HAS_IDS else rows
    seed = tl.load(seed_ptr) + tl.load(step_ptr) * 1000003
    # Tokens 4q .. 4q + 3 take the four outputs of Philox counter q: [ROWS, BLOCK / 4, 2, 2], token 4q + 2i + j.
    q = chunk * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    u0, u1, u2, u3 = tl.rand4x(seed, key[:, None] * tl.cdiv(V, 4) + q[None, :])
    u = tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), [ROWS, BLOCK])
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = row_ok[:, None] & (offs < V)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride + offs[None, :], mask=ok, other=float("-inf"))
    x = x.to(tl.float32)
    if SCALE:
        x = x * inv_t  # rounded on its own (the launch disables FMA fusion): the same x as torch's logits * inv_t
    e = -tl.log(u)  # Exp(1), to full fp32 accuracy also where u is near 1 (e near 0: the largest noise)
    # G = -log(e) with MUFU's log (error ~2^-22 absolute, far below the logits' resolution; 23 instructions per token
    # fewer); the interpreter has no fast log and takes numpy's.
    y = x - (libdevice.fast_logf(e) if FAST_LOG else tl.log(e))  # u == 0 gives -inf: never drawn
    y = tl.where(y == y, y, float("-inf"))  # NaN: never drawn
    top = tl.max(y, 1)
    idx = tl.min(tl.where(y == top[:, None], offs[None, :], 2147483647), 1)
    out = rows * C + chunk
    tl.store(y_ptr + out, top, mask=row_ok)
    tl.store(i_ptr + out, idx, mask=row_ok)
    if LOGPROB:
        m = tl.max(x, 1)
        e = tl.where(x == float("-inf"), 0.0, tl.exp(x - m[:, None]))
        tl.store(m_ptr + out, m, mask=row_ok)
        tl.store(s_ptr + out, tl.sum(e, 1), mask=row_ok)


@triton.jit
def _draw_combine_kernel(y_ptr, i_ptr, m_ptr, s_ptr, x_ptr, tok_ptr, lp_ptr, inv_t, B, stride, C, ROWS: tl.constexpr,
                         BLOCK_C: tl.constexpr, SCALE: tl.constexpr, LOGPROB: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < B
    c = tl.arange(0, BLOCK_C)
    ok = row_ok[:, None] & (c < C)[None, :]
    at = rows[:, None] * C + c[None, :]
    y = tl.load(y_ptr + at, mask=ok, other=float("-inf"))
    i = tl.load(i_ptr + at, mask=ok, other=2147483647)
    top = tl.max(y, 1)
    tok = tl.min(tl.where(y == top[:, None], i, 2147483647), 1)
    tl.store(tok_ptr + rows, tok.to(tl.int64), mask=row_ok)
    if LOGPROB:
        m = tl.load(m_ptr + at, mask=ok, other=float("-inf"))
        s = tl.load(s_ptr + at, mask=ok, other=0.0)
        big = tl.max(m, 1)
        total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - big[:, None])), 1)
        x = tl.load(x_ptr + rows.to(tl.int64) * stride + tok, mask=row_ok, other=0.0).to(tl.float32)
        if SCALE:
            x = x * inv_t
        tl.store(lp_ptr + rows, x - (big + tl.log(total)), mask=row_ok)


def _gumbel(x, seed, step, rows, inv_temperature: float, logprobs: bool, out=None):
    check_device(x)
    if x.ndim != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"The Gumbel draw takes float [B, V] logits, got {x.dtype} {tuple(x.shape)}.")
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, V = x.shape
    if B * V >= 2**31:
        raise ValueError(f"The Gumbel draw: batch x vocab = {B * V} exceeds the 2^31 noise counter; draw in chunks.")
    if rows is not None and (rows.shape != (B,) or rows.dtype != torch.int64):
        raise ValueError(f"The Gumbel draw: rows must be int64 [{B}], got {rows.dtype} {tuple(rows.shape)}.")
    block = max(4, min(CHUNK, triton.next_power_of_2(V)))
    C = triton.cdiv(V, block)
    # One row per program on the GPU (rows x chunks in parallel); the interpreter runs programs one after another,
    # so there a program takes every row. Neither the draw nor the log-prob depends on this tiling.
    per = 1 if x.is_cuda else triton.next_power_of_2(B)
    f32 = {"dtype": torch.float32, "device": x.device}
    y, m, s = (torch.empty(B, C, **f32) for _ in range(3))
    idx = torch.empty(B, C, dtype=torch.int32, device=x.device)
    tok = torch.empty(B, dtype=torch.int64, device=x.device) if out is None else out
    lp = torch.empty(B, **f32) if logprobs else y  # not written without logprobs
    ids = tok if rows is None else rows.contiguous()  # not read without rows
    scale = inv_temperature != 1.0
    grid = triton.cdiv(B, per)
    _draw_chunks_kernel[(grid, C)](x, y, idx, m, s, seed, step, ids, inv_temperature, B, V, x.stride(0), C,
                                   ROWS=per, BLOCK=block, SCALE=scale, HAS_IDS=rows is not None, LOGPROB=logprobs,
                                   FAST_LOG=not INTERPRETED, num_warps=4, enable_fp_fusion=False)  # fmt: skip
    _draw_combine_kernel[(grid,)](y, idx, m, s, x, tok, lp, inv_temperature, B, x.stride(0), C, ROWS=per,
                                  BLOCK_C=triton.next_power_of_2(C), SCALE=scale, LOGPROB=logprobs, num_warps=1,
                                  enable_fp_fusion=False)  # fmt: skip
    return (tok, lp) if logprobs else tok


def gumbel_argmax(x: torch.Tensor, seed: torch.Tensor, step: torch.Tensor, out: torch.Tensor | None = None,
                  rows: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Token ids int64 [B] drawn from ``softmax(x)`` (``x`` float [B, V], -inf for excluded tokens); ``seed`` and
    ``step`` are int64 device tensors of one element. ``rows`` (int64 [B], each in [0, B'), with B' * V < 2^31): the
    row whose noise each row of ``x`` draws with (default: its own)."""
    return _gumbel(x, seed, step, rows, 1.0, False, out)


def gumbel_sample(logits: torch.Tensor, seed: torch.Tensor, step: torch.Tensor, inv_temperature: float = 1.0,
                  rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(token ids int64 [B], their log-probs fp32 [B]) of a draw from ``softmax(x)``, ``x = fp32(logits) *
    inv_temperature`` (each product rounded to fp32, as torch computes it): the tokens are those of
    ``gumbel_argmax(x, seed, step, rows=rows)``, the log-probs ``log_softmax(x)`` at them, in one read of the
    logits."""
    return _gumbel(logits, seed, step, rows, float(inv_temperature), True)
