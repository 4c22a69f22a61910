# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The engine's hint and routing records: written inside each captured decode step, assembled into a `HintBatch`
after the rollout by `HintRecorder.collect` itself (prompt columns from the prefill's recorder, then one column per
decode step, the step's input token).

The prefill runs the model's layers, so it records through their `HintSite`s like `generate`. The decode steps do not:
the fused kernels write hints into the decoder's static buffers inside a CUDA graph, where no per-site Python call
can run, so `StepRecords` copies those buffers and hands them to `collect` as extra columns."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import fp4
from ...hints import HintBatch, HintRecorder, kv_rows


class StepRecords:
    """Per decode step, for every row of a bucket: the experts-input hints of hinted layers, the experts-hidden hints
    of layers hinted there, and every layer's routed experts. The "kv" hints are not copied per step: the decoder's
    FP4 cache holds them (the codes attention read), and `hints` reads them back from it.

    ``steps`` = 0 (not recording) allocates nothing per step. ``window`` < ``steps`` keeps only a window of that
    many steps on the device (step ``s`` in column ``s % window``, graph-safe) and `flush` moves each full window
    into CPU memory that `start` allocates per wave: the hints of a long rollout then take a window's bytes of
    the device, not the whole completion's, so more rows fit (what ``trace_hint_storage="cpu"`` asks for)."""

    def __init__(self, dec, steps: int, window: int | None = None):
        d, B, dev = dec.dims, dec.batch, dec.device
        H, n_h = d.hidden, len(dec.hinted)
        cols = steps if window is None else min(window, steps)
        self.steps, self.window, self.flushed = steps, cols, 0
        self.bits = torch.zeros(n_h, B, cols, H // 8, dtype=torch.uint8, device=dev)
        self.scale = torch.zeros(n_h, B, cols, H // 16, dtype=torch.uint8, device=dev)
        self.g = torch.zeros(n_h, B, cols, dtype=torch.float32, device=dev)
        self.hidden = tuple(torch.zeros(t.shape[0], B, cols, *t.shape[2:], dtype=t.dtype, device=dev)
                            for t in (dec.hidden_bits, dec.hidden_scale, dec.hidden_g))  # fmt: skip
        self.route = torch.zeros(d.num_layers if steps else 0, B, cols, d.top_k, dtype=torch.int16, device=dev)
        self.host: tuple[torch.Tensor, ...] | None = None  # a streaming wave's records, in `_device` order

    @property
    def streams(self) -> bool:
        return self.window < self.steps

    @staticmethod
    def bytes_per_row(dec_dims, n_hinted: int, n_hidden: int, steps: int) -> int:
        """What `StepRecords` allocates on the device per row for ``steps`` decode steps (its window's)."""
        d = dec_dims
        per_step = n_hinted * (d.hidden // 8 + d.hidden // 16 + 4) + 2 * d.top_k * d.num_layers
        per_step += n_hidden * d.top_k * (d.expert_dim // 8 + d.expert_dim // 16 + 4)
        return steps * per_step

    def _device(self) -> tuple[torch.Tensor, ...]:
        return (self.bits, self.scale, self.g, *self.hidden, self.route)

    def start(self) -> None:
        """A wave begins: when streaming, its CPU records (zeros past each row's stop, as on the device)."""
        self.flushed = 0
        if self.streams:
            self.host = tuple(torch.zeros(t.shape[:2] + (self.steps,) + t.shape[3:], dtype=t.dtype)
                              for t in self._device())  # fmt: skip

    def flush(self, steps: int) -> None:
        """Copy the window's steps up to ``steps`` (a multiple of the window, or the wave's last step) to the CPU
        records; one synchronizing copy per window, a few milliseconds against the window's decode steps."""
        n = steps - self.flushed
        if not self.streams or n <= 0:
            return
        assert self.flushed % self.window == 0 and n <= self.window, (self.flushed, steps, self.window)
        for cpu, dev in zip(self.host, self._device(), strict=True):
            cpu[:, :, self.flushed : steps].copy_(dev[:, :, :n])
        self.flushed = steps

    def write(self, dec, step: torch.Tensor, rows: torch.Tensor) -> None:
        """Record the decoder's step at column ``step`` (a device scalar: graph-safe) of rows ``rows`` (int64
        [dec.batch]: the record row of each decoder row, which compaction permutes; records stay in row order)."""
        at = rows * self.window + (step % self.window if self.streams else step)

        def put(rec, t):  # rec [n, rows, window, ...] <- t [n, dec.batch, ...]
            rec.flatten(1, 2).index_copy_(1, at, t)

        if dec.hinted:
            put(self.bits, dec.hint_bits)
            put(self.scale, dec.hint_scale)
            put(self.g, dec.hint_g)
        if dec.hidden_hinted:
            for rec, t in zip(self.hidden, (dec.hidden_bits, dec.hidden_scale, dec.hidden_g), strict=True):
                put(rec, t)
        put(self.route, dec.routing)

    def hints(self, recorder: HintRecorder, dec, out_tokens: torch.Tensor, B: int, steps: int,
              full_mask: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor | None = None,
              prompt_rows: torch.Tensor | None = None) -> HintBatch:  # fmt: skip
        """Prompt columns from the prefill's recorder, then one column per decode step (its input token); the decode
        steps' K/V hints are read from the decoder's FP4 cache afterwards, row ``b``'s from cache row ``slots[b]``
        (default ``b``; compaction moves a sequence's cache, not its records). ``prompt_rows`` [B]: the recorder's
        row that holds row ``b``'s prompt columns (a prefill of each distinct prompt once; None: row ``b``). A
        streaming wave's hints are assembled in CPU memory, where its records are."""
        records = self._device()
        if self.streams:
            self.flush(steps)
            records, self.host = self.host, None
        at = records[0].device

        def cols(t):  # [n_layers, batch, n, ...] -> [B, steps, n_layers, ...]
            return t[:, :B, :steps].movedim(0, 2)

        bits, scale, g, *hidden, route = records
        sites = {}
        if "experts_hidden" in recorder.plan:
            sites["experts_hidden"] = tuple(cols(t) for t in hidden)
        if "kv" in recorder.plan:
            kv_layers = [recorder.experts[i].kv_layer for i in recorder.plan["kv"]]
            rows = torch.arange(B, device=lengths.device) if slots is None else slots
            n = 8 if self.streams else B  # streaming: a few rows' K/V hints on the device at a time
            parts = [_kv_hints(dec, kv_layers, lengths[i : i + n], steps, rows[i : i + n]) for i in range(0, B, n)]
            sites["kv"] = tuple(torch.cat([p[k].to(at) for p in parts]) if len(parts) > 1 else parts[0][k].to(at)
                                for k in range(3))  # fmt: skip
        # decode step s fed completion token s
        decoded = (*(cols(t) for t in (bits, scale, g, route)), out_tokens[:B, :steps].to(at), sites)
        return recorder.collect(full_mask.to(at), prompt_rows, decoded)


def _kv_hints(dec, layers: list[int], lengths: torch.Tensor, steps: int, slots: torch.Tensor | None = None):
    """The "kv" hints of the decode steps at decoder layers `layers`, [B, steps, n_layers, 2, kv_heads, ...] (bits,
    block scales, row scales), from the FP4 cache: step s of row b wrote position ``lengths[b] + s`` of cache row
    ``slots[b]`` (default ``b``)."""
    B, dev = lengths.shape[0], lengths.device
    where = lengths[:, None].long() + torch.arange(steps, device=dev)  # [B, steps]
    rows = (torch.arange(B, device=dev) if slots is None else slots).view(B, 1, 1)

    def take(t):  # [batch, kv_heads, T, ...] -> [B, kv_heads, steps, ...]
        return t[rows, torch.arange(t.shape[1], device=dev).view(1, -1, 1), where.view(B, 1, steps)]

    per_layer = []
    for j in layers:
        c = dec.caches[j]
        qk, qv = (fp4.FP4Tensor(take(q), take(sc), take(g).unsqueeze(-1), "nvfp4")
                  for q, sc, g in ((c.k, c.k_scale, c.k_g), (c.v, c.v_scale, c.v_g)))  # fmt: skip
        h = fp4.extract_hints(kv_rows(qk, qv))
        per_layer.append((h.mantissa_bits, h.block_scale, h.global_scale.squeeze(-1)))
    return tuple(torch.stack([p[k] for p in per_layer], dim=1).unflatten(0, (B, steps)) for k in range(3))


def cat_hints(parts: list[HintBatch]) -> HintBatch:
    """The rows of several `HintBatch`es (waves of one rollout) in order, each padded with zeros to the longest
    sample (what `hint_batch_from_columns` puts past a row's length)."""
    if len(parts) == 1:
        return parts[0]
    L = max(p.routing.shape[1] for p in parts)

    def cat(ts):
        return torch.cat([F.pad(t, [0, 0] * (t.ndim - 2) + [0, L - t.shape[1]]) for t in ts], dim=0)

    first = parts[0]
    sites = {s: tuple(cat([p.site_hints[s][k] for p in parts]) for k in range(3)) for s in first.site_hints}
    ids = None if first.token_ids is None else cat([p.token_ids for p in parts])
    return HintBatch(cat([p.mantissa_bits for p in parts]), cat([p.block_scale for p in parts]),
                     cat([p.global_scale for p in parts]), cat([p.routing for p in parts]),
                     torch.cat([p.lengths for p in parts]), first.fmt, first.hint_layers, ids, sites)  # fmt: skip
