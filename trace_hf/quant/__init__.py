# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The quantizer side: what `from_pretrained(..., quantization_config=TraceFP4Config())` builds into a model.

`config` (`TraceFP4Config`), `quantizer` (the transformers `HfQuantizer` and load-time conversion), `experts`
(`TraceFP4Experts`: packed FP4 rollout path and QAT training path), `freshness` (when packed weights follow their
masters), `kv_cache` (FP4 KV cache and its training-side fake quantization) and `sites` (the `HintSite` per
(site, layer) through which `trace_hf.hints` records and guides).
"""

from .config import HINT_SITES, TraceFP4Config
from .experts import TraceFP4Experts, fp4_experts
from .freshness import refresh_fp4_weights
from .kv_cache import FP4KVLayer, fp4_cache, kv_bytes_per_token
from .quantizer import TraceFP4HfQuantizer, quantize_model
from .sites import HintSite


__all__ = [
    "HINT_SITES",
    "FP4KVLayer",
    "HintSite",
    "TraceFP4Config",
    "TraceFP4Experts",
    "TraceFP4HfQuantizer",
    "fp4_cache",
    "fp4_experts",
    "kv_bytes_per_token",
    "quantize_model",
    "refresh_fp4_weights",
]
