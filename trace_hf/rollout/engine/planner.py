# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Admission and wave planning: which rows of a rollout decode together, in which bucket, and whether they fit.

Why apart from the loop (`rollout`): these are host decisions over prompt ids and byte counts, made before a wave
runs (nano-vllm's scheduler beside its model runner), and they can be read, and tested, without a model.

* admission: as many rows decode at once as fit in the memory the engine may take (`memory_budget`; what a row
  costs is `runner.bytes_per_row`: the FP4 KV cache makes that several times more rows than BF16's; a shared
  prefill holds one prompt cache per distinct prompt, not per row); a rollout of more rows runs in equal waves, one
  after the other, in one bucket (`plan_waves`);
* buckets: a wave's rows round up to `runner.row_bucket`, its cache length to the engine's ``length_bucket``
  (`cache_length`), so a rollout of the same shape replays the same graph;
* shared prefill: a wave prefills each distinct prompt once and gives it to every row with that prompt
  (`distinct_prompts`);
* waves, not continuous batching: refilling freed rows with waiting ones would need a prefill per refill (small
  batches, each with its own hint recorder), per-row step counters in the sampler's noise key and the record columns,
  and each finished row's records (its FP4 K/V hints included, read from the cache it frees) collected before its
  row is reused. In GRPO the rows of a rollout usually fit at once, where refilling gains nothing; with compaction a
  wave's tail runs in small buckets.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .runner import RowBytes, largest_bucket, row_bucket


class WavePlan(NamedTuple):
    """A rollout's waves: ``rows`` rows a wave (the last may hold fewer), decoding in ``bucket_rows`` decoder rows;
    ``nbytes``: what the largest wave takes (its bucket decoding and its prefill)."""

    rows: int
    bucket_rows: int
    nbytes: int


def prompt_index(prompt_ids) -> list[int]:
    """Each row's prompt as an index among the distinct prompts, in order of first appearance."""
    index: dict[tuple, int] = {}
    return [index.setdefault(tuple(p), len(index)) for p in prompt_ids]


def cache_length(tokens: int, length_bucket: int) -> int:
    """The decoder's cache length for ``tokens`` (prompt and completion): rounded up to a multiple of
    ``length_bucket``, so that prompts of other lengths reuse a graph."""
    return -(-tokens // length_bucket) * length_bucket


def free_bytes(dev) -> int:
    """Device memory a new bucket can take: the free memory and the whole segments torch's allocator holds unused.
    The unused ends of segments still partly in use (``inactive_split_bytes``) are left out: a bucket's caches come
    in pieces of a GiB or more, which such fragments cannot hold (16 GiB of them at 56 x 128K on an H100)."""
    free, _ = torch.cuda.mem_get_info(dev)
    fragments = torch.cuda.memory_stats(dev).get("inactive_split_bytes.all.current", 0)
    return free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev) - fragments


def memory_budget(dev, memory_limit: int | None, fraction: float, cached: int) -> int | None:
    """Bytes one wave's rows may take (None: unlimited): ``memory_limit``, else on CUDA ``fraction`` of the free
    memory, counting the ``cached`` bytes of the engine's buckets as free (evicted before a new bucket is
    allocated)."""
    if memory_limit is not None:
        return int(memory_limit)
    if dev.type != "cuda":
        return None
    return int((free_bytes(dev) + cached) * fraction)


def plan_waves(prompt_ids, per_row: RowBytes, budget: int | None, max_rows: int | None, share_prefill: bool,
               bucketed: bool) -> WavePlan:  # fmt: skip
    """The fewest equal waves of ``prompt_ids`` whose every wave fits ``budget`` (at least ``per_row.total``): its
    bucket's rows decoding (``bucketed``: rows round up to `row_bucket`), and its prefill, which with
    ``share_prefill`` runs the wave's distinct prompts only (GRPO's repeated prompts admit more rows)."""
    rows = len(prompt_ids)
    prompt_of = prompt_index(prompt_ids) if share_prefill else range(rows)
    limit = min(max_rows or rows, rows)
    if budget is not None:  # no wave holds more rows than fit decoding in its bucket
        fit = budget // per_row.decode
        limit = max(1, min(limit, largest_bucket(fit) if bucketed else fit))
    waves = -(-rows // limit)
    while True:
        wave = -(-rows // waves)
        bucket = row_bucket(wave) if bucketed else wave
        prefilled = max(len(set(prompt_of[a : a + wave])) for a in range(0, rows, wave))
        need = per_row.wave(bucket, prefilled)
        if budget is None or need <= budget or waves == rows:  # one row a wave fits (the caller checks)
            return WavePlan(wave, bucket, need)
        waves += 1


def distinct_prompts(prompt_ids, dev) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A wave's distinct prompts, found on the host: (the first row of each, in order of first appearance; each
    row's index among them), as device int64 tensors; (None, None) when every prompt is distinct."""
    shared = prompt_index(prompt_ids)
    if len(set(shared)) == len(prompt_ids):
        return None, None
    first: dict[int, int] = {}
    for b, u in enumerate(shared):
        first.setdefault(u, b)
    first_rows = torch.tensor(list(first.values()), dtype=torch.int64, device=dev)
    return first_rows, torch.tensor(shared, dtype=torch.int64, device=dev)
