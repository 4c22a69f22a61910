# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""trace-hf: rollout-guided FP4 quantization-aware RL (TRACE) for mixture-of-experts models.

Importing the package registers the `trace_fp4` quantization method with transformers, so that
`from_pretrained` can reload checkpoints saved with `TraceFP4Config`.
"""

import importlib.machinery as _machinery
import importlib.util as _importlib_util
import os as _os
import sys as _sys
import warnings as _warnings


def _find_kernels() -> None:
    """Make `trace_hf.kernels` importable wherever `trace_hf` itself was found.

    kernels/ sits beside trace_hf/ in the repository and installs as trace_hf.kernels (package-dir mapping); it has
    no `__init__.py` on purpose (see kernels/README.md). A regular or strict editable install maps it, but a source
    tree first on sys.path (the repository root as cwd, `python -m pytest`, a notebook in the clone) and setuptools'
    default editable mode find trace_hf/ alone. Then the folder beside the package is bound here under the full
    name, with the import system's own PathFinder: no top-level `kernels` on sys.path, no extra finder kept in
    sys.meta_path, and an installed mapping still wins because it is looked up first.
    """
    name = f"{__name__}.kernels"
    if _importlib_util.find_spec(name) is not None:
        return
    spec = _machinery.PathFinder.find_spec(name, [_os.path.dirname(__path__[0])])
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"trace_hf.kernels (the Triton kernels, kernels/ in the repository) is missing: trace_hf was imported "
            f"from {__path__[0]} and no kernels/ folder sits beside it. Reinstall trace-hf (`pip install .`, or "
            "`pip install -e .` in a clone)."
        )
    module = _importlib_util.module_from_spec(spec)
    _sys.modules[name] = module
    globals()["kernels"] = module  # as the import system binds a submodule on its parent


_find_kernels()

# TRL reads `model.is_gradient_checkpointing`, which transformers 5 deprecates in favour of
# `is_activation_checkpointing`; users never touch it, so its FutureWarning (once per training step) is noise.
_warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)

from . import fp4  # noqa: E402
from .quant.config import TraceFP4Config  # noqa: E402
from .quant.quantizer import TraceFP4HfQuantizer  # noqa: E402


__version__ = "0.1.0"

_LAZY = {
    "HintRecorder": "hints",
    "HintBatch": "hints",
    "use_hints": "hints",
    "MismatchReport": "hints",
    "hint_bytes_per_token": "hints",
    "hint_bytes_per_token_by_site": "hints",
    "refresh_fp4_weights": "quant.freshness",
    "make_rollout": "rollout",
    "RolloutOutput": "rollout",
    "TraceGRPOConfig": "train",
    "TraceGRPOTrainer": "train",
}


def __getattr__(name):
    # The hint and trainer modules import TRL and friends; load them on first use.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'trace_hf' has no attribute {name!r}")


__all__ = ["fp4", "TraceFP4Config", "TraceFP4HfQuantizer", "__version__", *_LAZY]
