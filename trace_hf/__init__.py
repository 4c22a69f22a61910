# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""trace-hf: rollout-guided FP4 quantization-aware RL (TRACE) for mixture-of-experts models.

Importing the package registers the `trace_fp4` quantization method with transformers, so that
`from_pretrained` can reload checkpoints saved with `TraceFP4Config`.
"""

import importlib.util as _importlib_util
import warnings as _warnings


def _check_kernels() -> None:
    # kernels/ installs as trace_hf.kernels through a package-dir mapping that setuptools' default (lenient) editable
    # mode cannot express, and a source tree first on sys.path shadows a good install the same way. Either way the
    # install "works" until the first CUDA forward; say so now, with the fix.
    if _importlib_util.find_spec(f"{__name__}.kernels") is not None:
        return
    raise ImportError(
        f"trace_hf.kernels (the Triton kernels, kernels/ in the repository) is missing: trace_hf was imported from "
        f"{__path__[0]}. Install with `pip install -e . --config-settings editable_mode=strict` (the default "
        "editable mode cannot map kernels/ to trace_hf.kernels) or without -e. If it is installed that way already, "
        "the repository's source folder is shadowing the install: run from another directory, and run the tests "
        "with `pytest`, not `python -m pytest`."
    )


_check_kernels()

# TRL reads `model.is_gradient_checkpointing`, which transformers 5 deprecates in favour of
# `is_activation_checkpointing`; users never touch it, so its FutureWarning (once per training step) is noise.
_warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)

from . import fp4  # noqa: E402
from .config import TraceFP4Config  # noqa: E402
from .quantizer import TraceFP4HfQuantizer  # noqa: E402


__version__ = "0.1.0"

_LAZY = {
    "HintRecorder": "hints",
    "HintBatch": "hints",
    "use_hints": "hints",
    "MismatchReport": "hints",
    "hint_bytes_per_token": "hints",
    "hint_bytes_per_token_by_site": "hints",
    "refresh_fp4_weights": "experts",
    "make_rollout": "rollout",
    "RolloutOutput": "rollout",
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
