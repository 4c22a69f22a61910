# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Saving the trained FP4 policy and loading it back: `export_fp4` / `load_fp4`.

`trace_fp4` writes trace-hf's own checkpoint (packed experts beside the other weights; the default format);
`compressed` writes compressed-tensors' NVFP4 checkpoint, which vLLM and SGLang serve
(``format="compressed-tensors"``), and reads one back to start RL from it.
"""

from .trace_fp4 import export_fp4, load_fp4


__all__ = ["export_fp4", "load_fp4"]
