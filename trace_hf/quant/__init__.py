# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The quantizer side: what `from_pretrained(..., quantization_config=TraceFP4Config())` builds into a model.

`config` (`TraceFP4Config`), `quantizer` (the transformers `HfQuantizer` and load-time conversion), `experts`
(`TraceFP4Experts`: packed FP4 rollout path and QAT training path) with `expert_weights` (where its weights are
kept, and the conversions) and `expert_paths` (what each of its forwards computes), `freshness` (when packed weights
follow their masters), `kv_cache` (FP4 KV cache and its training-side fake quantization) and `sites` (the `HintSite`
per (site, layer) through which `trace_hf.hints` records and guides).

Nothing is imported here: `import trace_hf` loads only the config and the quantizer; the other modules pull in
transformers' modeling code, which a bare import should not.
"""
