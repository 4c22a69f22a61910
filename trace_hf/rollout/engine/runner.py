# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""One bucket of the engine: a decoder of a fixed number of rows and cache length, the sampler's state and the
step records, and (on CUDA) the decode step captured in a CUDA graph, replayed once per token.

Buckets: rows round up to a power of two up to 8, to a multiple of 8 up to 64, of 16 up to 128, of 32 up to 256
and of 64 above (`row_bucket`: at most 7, 15, 31 and 63 padding rows); cache lengths to a multiple of the engine's
``length_bucket``. So a rollout of the same shape replays the same graph, one of 257-320 rows does not pay for 512,
where memory admits 26 rows at long context a wave takes 24 of them, not 16, and the ~150 rows of a 256-row GRPO
rollout that run to the length cap decode their tail in 160 rows, not 192. `bytes_per_row` is what the planner
(`planner.plan_waves`) admits by: the memory one row of a bucket takes, and its prefill.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from ..sampling import SamplingSettings, sample
from .decoder import FastDecoder, swap_rows
from .kernels import kernels
from .recording import StepRecords
from .weights import DecodeWeights


#: Row counts up to FINE_STEP round up to a power of two, up to 8 * FINE_STEP to a multiple of FINE_STEP, above to
#: BUCKETS_PER_OCTAVE even steps of their octave (65-128 rows: multiples of 16; 129-256: of 32), at most ROW_STEP.
FINE_STEP = 8
ROW_STEP = 64
BUCKETS_PER_OCTAVE = 4  # 1: a multiple of 64 past 64 rows, the buckets before (benchmarks' --coarse-buckets)


def _step(rows: int) -> int:
    if rows <= 8 * FINE_STEP:
        return FINE_STEP
    return min(ROW_STEP, (1 << (rows - 1).bit_length()) // (2 * BUCKETS_PER_OCTAVE))


def row_bucket(rows: int) -> int:
    """The bucket (decoder rows, one CUDA graph each) that ``rows`` rows decode in."""
    if rows < 1:
        raise ValueError(f"rows={rows}: a bucket holds at least one row.")
    if rows <= FINE_STEP:
        return 1 << (rows - 1).bit_length()
    return -(-rows // _step(rows)) * _step(rows)


def buckets_below(rows: int) -> list[int]:
    """The buckets smaller than ``rows`` rows, largest first: where compaction can move a wave's live rows."""
    return sorted({b for b in map(row_bucket, range(1, rows)) if b < rows}, reverse=True)


def largest_bucket(cap: int) -> int:
    """The largest bucket of at most ``cap`` rows (0 if not even one row)."""
    if cap < 1:
        return 0
    if cap < FINE_STEP:
        return 1 << (cap.bit_length() - 1)
    step = _step(cap)
    return cap // step * step


@dataclasses.dataclass(frozen=True)
class RowBytes:
    """Device bytes a wave takes, per row (what the engine admits by). ``decode``: what each row of the bucket
    holds while the wave decodes (its static KV cache, linear-attention states, logits and the sampler's
    temporaries, output buffers, step records); ``prefill``: the transformers cache of one prefilled prompt, alive
    until it is copied into the static cache. With a shared prefill a wave prefills its distinct prompts only."""

    decode: int
    prefill: int

    def wave(self, bucket_rows: int, prefilled: int) -> int:
        """Bytes of a wave decoding in ``bucket_rows`` rows whose prefill ran ``prefilled`` prompts."""
        return bucket_rows * self.decode + prefilled * self.prefill

    @property
    def total(self) -> int:
        """One row that is prefilled on its own: the least a wave needs."""
        return self.decode + self.prefill


def bytes_per_row(w: DecodeWeights, length: int, prompt_len: int, s: SamplingSettings, kv_fp4: bool,
                  record: bool, record_window: int | None = None) -> RowBytes:  # fmt: skip
    """What one row takes (`RowBytes`): its static KV cache of ``length`` tokens (FP4: codes and scales),
    linear-attention states, logits and the sampler's fp32 [V] temporaries, the output buffers and, when recording,
    the step records (`StepRecords.bytes_per_row`: of every step, or of ``record_window`` steps when they stream to
    CPU memory); and the prefill's cache of its ``prompt_len`` tokens."""
    d = w.dims
    kv = kernels().attention.kv_bytes_per_token(d.num_kv_heads, d.head_dim, kv_fp4, w.embed.element_size())
    need = length * kv * w.num_kv_layers + w.state_bytes_per_row()
    need += 9 * d.vocab * 4 + (d.vocab if s.repetition_penalty else 0) + 12 * s.max_new_tokens
    if record:
        hinted = [lw for lw in w.layers if lw.hinted] if w.fp4_experts else []
        n_in = sum("experts_input" in lw.hint_sites for lw in hinted)
        n_hidden = sum("experts_hidden" in lw.hint_sites for lw in hinted)
        need += StepRecords.bytes_per_row(d, n_in, n_hidden, min(s.max_new_tokens, record_window or s.max_new_tokens))
    return RowBytes(need, prompt_len * kv * w.num_kv_layers)


class Runner:
    """Static buffers, the decoder and (on CUDA) the captured step of one (rows, length, sampling) bucket.

    The sampler's state lives in device tensors the graph reads: ``seed`` and ``step`` (the counter-based draw's
    key), ``finished`` (rows that emitted an EOS, or padding rows), ``retired`` (finished rows whose last token, the
    EOS, a step has fed: the rows compaction may drop, so that every kept token's records exist), ``out_tokens`` /
    ``out_logps`` [rows, max_new_tokens] (column 0: the prefill's draw; column s + 1: decode step s's), ``seen``
    (the repetition penalty's tokens so far), ``row_ids`` (the row of the outputs, records and sampling noise that each decoder row
    holds: compaction permutes the decoder's rows, not the outputs).

    With ``compaction``, ``smaller`` holds a runner for every bucket below this one (`buckets_below`) that steps
    this one's first rows in place (`first_rows`: views, no memory of their own but their graphs' shared pool).
    ``record_window``: keep that many steps of records on the device and stream the rest to CPU memory
    (`StepRecords`)."""

    def __init__(self, w: DecodeWeights, batch: int, max_len: int, s: SamplingSettings, kv_fp4: bool, record: bool,
                 decoder: type[FastDecoder] = FastDecoder, compaction: bool = False,
                 record_window: int | None = None):  # fmt: skip
        d = w.dims
        self.s, self.batch, self.record = s, batch, record
        self.dec = decoder(w, batch, max_len, kv_fp4=kv_fp4, record_hints=record, record_routing=record,
                           sample=self._sample)  # fmt: skip
        dev = self.dec.device
        n = s.max_new_tokens
        self.seed = torch.zeros(1, dtype=torch.int64, device=dev)
        self.step = torch.zeros(1, dtype=torch.int64, device=dev)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.retired = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.row_ids = torch.arange(batch, dtype=torch.int64, device=dev)
        self.eos = torch.tensor(list(s.eos_token_id) or [-1], dtype=torch.int64, device=dev)
        self.out_tokens = torch.zeros(batch, n, dtype=torch.int64, device=dev)
        self.out_logps = torch.zeros(batch, n, dtype=torch.float32, device=dev)
        self.seen = torch.zeros(batch, d.vocab, dtype=torch.bool, device=dev) if s.repetition_penalty else None
        self.records = StepRecords(self.dec, n if record else 0, record_window)
        self.smaller: dict[int, Runner] = {b: self.first_rows(b) for b in buckets_below(batch)} if compaction else {}

    def reset(self, seed: int, ids: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor,
              logits: torch.Tensor) -> None:  # fmt: skip
        """Start a wave of ``ids.shape[0]`` rows (left-padded prompts ``ids`` / ``mask`` of ``lengths`` tokens) in
        this bucket: every field a wave changes back to its start, the rows past the wave stopped from the start
        (padding), and each row's first token drawn from the prefill's ``logits`` (step -1 of the draw's key), which
        the decoder feeds at step 0. Here, so that the state a wave runs on is declared in one class."""
        B, dec = ids.shape[0], self.dec
        self.seed.fill_(seed)
        self.step.fill_(-1)
        self.records.start()
        self.finished.zero_()
        self.finished[B:] = True
        self.retired.copy_(self.finished)
        torch.arange(self.batch, out=self.row_ids)
        if self.seen is not None:
            self.seen.zero_()
            self.seen[:B].scatter_(1, torch.where(mask.bool(), ids, ids[:, -1:]), True)  # pads: the last (real) id
        tok0, lp0 = sample(logits, self.s, self.seed, self.step, seen=None if self.seen is None else self.seen[:B])
        self.out_tokens.zero_()
        self.out_tokens[:B, 0] = tok0
        self.out_logps[:B, 0] = lp0
        self.finished[:B] |= torch.isin(tok0, self.eos)
        if self.seen is not None:
            self.seen[:B].scatter_(1, tok0.unsqueeze(1), True)
        dec.tokens.zero_()
        dec.tokens[:B] = tok0
        dec.positions.zero_()
        dec.positions[:B] = lengths.to(torch.int32)
        self.step.zero_()

    def first_rows(self, rows: int) -> Runner:
        """A runner that steps this one's first ``rows`` decoder rows (views of its state; the same outputs,
        records, seed and step)."""
        v = copy.copy(self)
        v.batch, v.smaller = rows, {}
        v.finished, v.retired, v.row_ids = self.finished[:rows], self.retired[:rows], self.row_ids[:rows]
        v.seen = None if self.seen is None else self.seen[:rows]
        v.dec = self.dec.first_rows(rows, sample=v._sample)
        return v

    def swap_rows(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Exchange decoder rows ``a`` and ``b`` (int64 [n] each, disjoint): the sequences' caches, states, sampler
        state and row ids move; outputs and records, kept by row id, stay."""
        carried = [self.finished, self.retired, self.row_ids] + ([self.seen] if self.seen is not None else [])
        swap_rows(carried + self.dec.carried_tensors(), a, b)

    def _sample(self, dec: FastDecoder) -> None:
        """End of a decode step (graph-safe): draw the next token, record it, its log-prob and the step's hints."""
        s = self.s
        tok, lp = sample(dec.logits, s, self.seed, self.step, self.row_ids, self.seen)
        tok = torch.where(self.finished, torch.full_like(tok, s.pad_token_id), tok)
        at = self.row_ids * self.out_tokens.shape[1] + (self.step + 1)
        self.out_tokens.view(-1).index_copy_(0, at, tok)
        self.out_logps.view(-1).index_copy_(0, at, lp)
        if self.record:
            self.records.write(dec, self.step, self.row_ids)
        self.retired.copy_(self.finished)  # rows finished before this step: it fed their EOS
        # Not torch.isin: from 10 * B^0.145 EOS ids on (10 at one row) it sorts, which syncs and breaks the capture.
        self.finished |= (tok[:, None] == self.eos[None, :]).any(1)
        if self.seen is not None:
            self.seen.scatter_(1, tok.unsqueeze(1), True)
        dec.tokens.copy_(tok)
        self.step.add_(1)

    def capture(self) -> None:
        """Capture the step of this bucket and of each smaller one (sharing one graph memory pool: they run one at a
        time and keep nothing in it between steps)."""
        pool = None
        for r in (self, *self.smaller.values()):
            self.step.zero_()
            self.finished.zero_()
            r.dec.capture(pool=pool)
            pool = self.dec.graph.pool()
