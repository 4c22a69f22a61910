# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Run a benchmark module with the host's stalls printed to stderr, to tell a slow call's cause from its work:

    python -m benchmarks.stall_log benchmarks.training.grpo_step --layers 48 ...

prints ``JIT <s> <kernel> <variant>`` for every Triton kernel that misses the in-memory cache (a compile, or a disk
load of a new specialization) and ``GC <s> <generation> <ms> <collected>`` for every Python GC pass over 20 ms, with
seconds since start; the benchmark's ``STEP`` lines in the same log place them in steps. ``GC_FREEZE=1`` moves the
heap into the permanent generation (`gc.freeze`) when `Trainer.train` starts, so that GC passes skip it.
"""

from __future__ import annotations

import gc
import os
import runpy
import sys
import time


T0 = time.perf_counter()
_gc_start = [0.0]


def _on_miss(*args, **kwargs) -> bool:
    fn = kwargs.get("fn")
    name = getattr(fn, "name", None) or getattr(fn, "__name__", "?")
    # the whole variant: its arguments' types and specializations are what tell one compile of a kernel from another
    print(f"JIT {time.perf_counter() - T0:.2f} {name} {kwargs.get('repr', '')}", file=sys.stderr, flush=True)
    return False  # go on compiling (True would skip the launch)


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_start[0] = time.perf_counter()
        return
    ms = (time.perf_counter() - _gc_start[0]) * 1e3
    if ms > 20:
        print(f"GC {time.perf_counter() - T0:.2f} {info['generation']} {ms:.0f} {info['collected']}", file=sys.stderr,
              flush=True)  # fmt: skip


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2
    from triton import knobs

    knobs.runtime.jit_cache_hook = _on_miss
    gc.callbacks.append(_on_gc)
    if os.environ.get("GC_FREEZE") == "1":
        import transformers

        train = transformers.Trainer.train

        def frozen_train(self, *args, **kwargs):
            gc.collect()
            gc.freeze()
            print(f"GC_FREEZE {gc.get_freeze_count()} objects", file=sys.stderr, flush=True)
            return train(self, *args, **kwargs)

        transformers.Trainer.train = frozen_train
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
