# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The rollout engine: batched prefill through the transformers model, then decode steps replayed from CUDA graphs.

A small package in the spirit of nano-vllm, one module per job:

* `layouts`: one `Layout` entry per model family (where its decode weights live, which decoder steps it);
* `weights`: the decode weights (`Dims`, `DecodeWeights`) read through a family's layout map, and kept equal to
  the model's before every rollout (`EngineWeights`; under FSDP2 `ShardedWeights`); it imports no layout, the
  layouts import it (`layouts.weights_from_hf`);
* `decoder` (`FastDecoder`, Qwen3 MoE) and `qwen35` (`HybridDecoder`, Qwen3.5 MoE): static buffers and one decode
  step over them; `kernels`: the Triton kernel modules they call, by name;
* `planner`: admission and wave planning (which rows decode together, in which bucket, whether they fit the
  memory budget), host decisions made before a wave runs;
* `runner`: one bucket (`Runner`: rows, cache length, sampler state and its reset, the CUDA graph), `row_bucket`,
  and what a row costs in memory (`bytes_per_row`, what the planner counts);
* `recording`: the hint and routing records of the decode steps, assembled into a `HintBatch`;
* `rollout`: the `EngineRollout` front (what `trace_hf.rollout.make_rollout` returns: the bucket cache, and per wave
  the prefill, the cache load and the decode loop) and `EngineStats`; `support`: `unsupported_reason`, what the
  engine can roll out.

Data flows: model -> `weights` (refresh) -> `planner` (the waves) -> `Runner` of the wave's bucket -> prefill
through the model, its cache copied into the decoder's -> decode steps (graph replays) writing tokens, log-probs and
step records -> per wave a `RolloutOutput` part, joined in row order.
"""

from __future__ import annotations

from .decoder import FastDecoder, rope_tables
from .layouts import weights_from_hf
from .qwen35 import HybridDecoder
from .rollout import EngineRollout, EngineStats
from .support import LORA_TARGETS, kv_format, unsupported_reason
from .weights import DecodeWeights, Dims, LayerWeights, quantize_experts


__all__ = [
    "EngineRollout",
    "EngineStats",
    "unsupported_reason",
    "kv_format",
    "LORA_TARGETS",
    "Dims",
    "LayerWeights",
    "DecodeWeights",
    "FastDecoder",
    "HybridDecoder",
    "weights_from_hf",
    "quantize_experts",
    "rope_tables",
]
