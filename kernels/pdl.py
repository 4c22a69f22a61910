# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Programmatic dependent launch (PDL) for the decode step's kernels on sm_90+.

Why: at batch 1 a decode step is some 600 kernels of 2-10 us each, and the gap between one kernel's end and the
next one's first loads is a large share of each. Launched with PDL, a kernel may be scheduled before its predecessor
has finished. Every such kernel begins with `wait_for_producer`: ``griddepcontrol.wait`` blocks until the
predecessor has finished and its writes are visible, so nothing is read or written early, and then
``griddepcontrol.launch_dependents`` lets its own successor be scheduled as soon as all of its programs run
(releasing only after the GEMMs' main loops was slower for both paths, docs/lab-notes.md 2f). The experts' Triton
kernels with BF16 weights and the attention's split kernels take no PDL: each was slower with it (docs/lab-notes.md 2f;
the split kernels of small grids may, `fp4_attention.split_launch_options`). CUDA
graphs keep these edges. Off in the interpreter and below sm_90, where the kernels take ``PDL=False``.
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.pdl (see kernels/README.md), not kernels.pdl.")

import contextlib  # noqa: E402
import contextvars  # noqa: E402
import functools  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

from trace_hf.kernels.common import INTERPRETED  # noqa: E402


#: Switch for measurements (`benchmarks/rollout/rollout_decode.py --no-pdl`); the kernels are correct either way.
ENABLED = True

#: ``max_rows``: decode steps of more rows (`for_rows`) launch without PDL; None: every step with it. Where a step's
#: kernels are long, an early-scheduled successor only takes SM slots from its producer's tail: without PDL from
#: 128 rows on, the 48-layer step at 1K gained 0.5-0.8% at 128, 1.2% at 256 and 0.8-1.8% at 512 in both precisions
#: (two rounds each), while batch 1 is 10% slower without it (docs/lab-notes.md 10).
CONFIG = {"max_rows": 64}

#: The rows of the decode step whose kernels are being launched (`for_rows`); None outside one.
_STEP_ROWS: contextvars.ContextVar[int | None] = contextvars.ContextVar("trace_hf_pdl_step_rows", default=None)


@contextlib.contextmanager
def for_rows(rows: int):
    """Launches inside are a decode step's of ``rows`` rows (its eager run or its graph capture), which take PDL
    only up to ``CONFIG["max_rows"]``."""
    token = _STEP_ROWS.set(rows)
    try:
        yield
    finally:
        _STEP_ROWS.reset(token)


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a launch of a kernel with a ``PDL`` constexpr: ``PDL=True, launch_pdl=True`` on an
    sm_90+ GPU (unless `ENABLED` is off, or a `for_rows` step has more rows than ``CONFIG["max_rows"]``), else
    ``PDL=False``."""
    rows, cap = _STEP_ROWS.get(), CONFIG["max_rows"]
    on = ENABLED and (rows is None or cap is None or rows <= cap)
    on = on and not INTERPRETED and device.type == "cuda" and _supported(device.index or 0)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def wait_for_producer(PDL: tl.constexpr):
    """The first statement of a PDL kernel: wait until the previous kernel has finished and its writes are visible,
    then let the next kernel be scheduled (once every program of this one has got here or exited)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
