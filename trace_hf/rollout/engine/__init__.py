# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The rollout engine: batched prefill through the transformers model, then decode steps replayed from CUDA graphs.

A small package in the spirit of nano-vllm, one module per job:

* `layouts`: one `Layout` entry per model family (where its decode weights live, which decoder steps it);
* `decoder` (`FastDecoder`, Qwen3 MoE) and `qwen35` (`HybridDecoder`, Qwen3.5 MoE): static buffers and one decode
  step over them;
* `rollout`: the `EngineRollout` front (what `trace_hf.rollout.make_rollout` returns) and `unsupported_reason`.
"""

from __future__ import annotations

from .decoder import FastDecoder, rope_tables
from .qwen35 import HybridDecoder
from .rollout import LORA_TARGETS, EngineRollout, kv_format, unsupported_reason
from .weights import DecodeWeights, Dims, LayerWeights, lora_weight, quantize_experts, weights_from_hf


__all__ = [
    "EngineRollout",
    "unsupported_reason",
    "kv_format",
    "lora_weight",
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
