# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""trace-hf: rollout-guided FP4 quantization-aware RL (TRACE) for mixture-of-experts models.

Importing the package registers the `trace_fp4` quantization method with transformers, so that
`from_pretrained` can reload checkpoints saved with `TraceFP4Config`.
"""

from . import fp4
from .config import TraceFP4Config
from .quantizer import TraceFP4HfQuantizer


__version__ = "0.1.0"

_LAZY = {
    "HintRecorder": "hints",
    "HintBatch": "hints",
    "use_hints": "hints",
    "MismatchReport": "hints",
    "hint_bytes_per_token": "hints",
    "TraceGRPOConfig": "trainer",
    "TraceGRPOTrainer": "trainer",
}


def __getattr__(name):
    # The hint and trainer modules import TRL and friends; load them on first use.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'trace_hf' has no attribute {name!r}")


__all__ = ["fp4", "TraceFP4Config", "TraceFP4HfQuantizer", "__version__", *_LAZY]
