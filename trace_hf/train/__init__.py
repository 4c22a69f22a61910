# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The training side: TRL's GRPO with TRACE. `config` (`TraceGRPOConfig`), `trainer` (`TraceGRPOTrainer`),
`importance` (the sampler correction), `metrics` (the `trace/*` reductions), `trl_options` (TRL options this
trainer refuses, and why), `packing` (padding-free forwards), `delta_rule` (Gated DeltaNet's recurrent values),
`rms_norm` and `rope` (the fused glue of training-side forwards), `adapter_casts` (PEFT adapters' inputs left uncast
under autocast)."""

from .config import TraceGRPOConfig
from .importance import IS_MODES, importance_sampling_ratio
from .trainer import TraceGRPOTrainer


__all__ = ["IS_MODES", "TraceGRPOConfig", "TraceGRPOTrainer", "importance_sampling_ratio"]
