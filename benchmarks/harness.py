# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""What the benchmarks share: the device they run on, timing, the copy bandwidth they quote fractions of, JSON
output, overrides of the kernels' launch settings for A/B runs, running another benchmark in this process, and the
trainer-kernel flags of the training benchmarks.

Imported as ``benchmarks.harness``: run the benchmarks as modules from the repository root
(``python -m benchmarks.rollout.rollout_decode ...``), so that no script puts another's folder on ``sys.path``.
torch is imported inside the functions, so that ``--help`` stays fast and `setup_device` can set
``TRITON_INTERPRET`` before anything imports Triton.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib
import json
import os
import runpy
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any


@dataclasses.dataclass(frozen=True)
class Device:
    """Where a benchmark runs: the GPU in BF16, or (``--smoke``) the CPU in fp32 through Triton's interpreter."""

    cuda: bool
    device: Any  # torch.device
    dtype: Any  # torch.dtype
    name: str


def setup_device(script: str, smoke: bool = False, gpu_only: bool = False) -> Device | None:
    """The GPU if there is one; else, with ``smoke`` (and not ``gpu_only``), the CPU with ``TRITON_INTERPRET=1`` set
    before Triton is imported. None, with the reason printed, when neither applies: the caller returns exit code 2."""
    import torch

    if torch.cuda.is_available():
        return Device(True, torch.device("cuda"), torch.bfloat16, torch.cuda.get_device_name())
    if gpu_only:
        print(f"{script} needs a CUDA GPU.", file=sys.stderr)
        return None
    if not smoke:
        print(f"{script}: no CUDA device; run it with --smoke (interpreter) or on the GPU.", file=sys.stderr)
        return None
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return Device(False, torch.device("cpu"), torch.float32, "cpu (interpreter)")


def add_kernel_flags(p: argparse.ArgumentParser, adapter_casts: bool = True) -> None:
    """The trainer's fused-kernel and PEFT-cast switches, as flags named after the `TraceGRPOConfig` fields they turn
    off, so that every training benchmark spells and means them the same: ``--no-fused`` and, with
    ``adapter_casts``, ``--keep-adapter-casts``."""
    p.add_argument("--no-fused", action="store_true",
                   help="TraceGRPOConfig(fused_rms_norm=False, fused_rope=False): transformers' RMSNorm and rotary ops, "
                        "the before of the fused kernels")  # fmt: skip
    if adapter_casts:
        p.add_argument("--keep-adapter-casts", action="store_true",
                       help="TraceGRPOConfig(disable_input_dtype_casting=False): PEFT casts each LoRA adapter's input "
                            "to the adapter's fp32 under autocast, and autocast casts it back")  # fmt: skip


def time_per_call(
    fn: Callable[[], Any], n: int, warmup: int = 3, cuda: bool | None = None, wall: bool = False
) -> float:
    """Seconds per call of ``fn``: CUDA events around ``n`` calls in a row after ``warmup`` calls; on the CPU
    (``cuda``: default, whether there is a GPU), the wall clock. Events time the GPU's stream, so a graph replay is
    timed without the host's launch latency; ``wall`` times the wall clock up to the GPU's finishing instead, host
    time included."""
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    if wall or not cuda:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / n
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e-3 / n


def call_times(fn: Callable[[], Any], n: int, warmup: int = 1, cuda: bool | None = None, wall: bool = False) -> list:
    """Seconds of each of ``n`` calls of ``fn``, each timed on its own by `time_per_call`, after ``warmup`` calls:
    for a median over repeats of a long call (a training step), where one slow repeat must not weigh in."""
    for _ in range(warmup):
        fn()
    return [time_per_call(fn, 1, warmup=0, cuda=cuda, wall=wall) for _ in range(n)]


def kernel_times(run: Callable[[], Any], n: int = 3, top: int = 12) -> dict:
    """Where the GPU time of ``run`` (a graph replay or a step) goes, by kernel (torch.profiler, graph replays
    included): ``us`` per call, ``launches`` per call, and the ``top`` kernels as [name, us per call, share]."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            run()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / n, e.count / n) for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(t for _, t, _ in rows) or 1.0
    rows.sort(key=lambda r: -r[1])
    return {"us": round(total, 1), "launches": round(sum(c for *_, c in rows), 1),
            "top": [[k[:80], round(t, 1), round(t / total, 3)] for k, t, _ in rows[:top]]}  # fmt: skip


def copy_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second by a device-to-device copy of ``nbytes``: the bound the benchmarks quote
    their bandwidth as a fraction of (a memory-bound kernel can at best move bytes at this rate)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    return 2 * nbytes / time_per_call(lambda: dst.copy_(src), 10)


def fmt(v, spec: str = ".1f") -> str:
    """A table cell: ``v`` formatted, or "-" where a cell has no value (skipped, out of memory)."""
    return "-" if v is None else format(v, spec)


def write_json(path: str, obj: Any, indent: int = 1) -> None:
    """``obj`` as JSON at ``path`` (its folder made if missing; values JSON does not know written as str)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent, default=str)


def save_sweep(path: str, rows: list, best: dict, copy_bw: float, seconds: float) -> None:
    """Write a launch-config sweep's JSON (every config tried, the best per cell) and print its one-line summary."""
    import torch

    write_json(path, {"device": torch.cuda.get_device_name(), "copy_bw": copy_bw, "rows": rows,
                      "best": {str(k): v for k, v in best.items()}, "seconds": seconds})  # fmt: skip
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s; {len(rows)} configs in {seconds:.0f} s; JSON: {path}")


def kernel_setting(key: str) -> tuple[Any, str]:
    """(module, attribute) of ``"module.NAME"``, a launch setting of `trace_hf.kernels`, e.g. ``"pdl.ENABLED"``,
    ``"fp4_moe_configs.HOPPER"``, ``"decode_ops.GEMV"``; a name that is not there is an error that says so."""
    mod_name, _, attr = key.rpartition(".")
    try:
        mod = importlib.import_module(f"trace_hf.kernels.{mod_name}")
    except ImportError as e:
        raise ValueError(f"{key!r}: no module trace_hf.kernels.{mod_name} ({e}); write 'module.NAME'.") from e
    if not mod_name or not hasattr(mod, attr):
        raise ValueError(f"{key!r}: trace_hf.kernels.{mod_name} has no setting {attr!r}.")
    return mod, attr


@contextlib.contextmanager
def override(settings: dict[str, Any]) -> Iterator[None]:
    """Run a block with launch settings of `trace_hf.kernels` changed, and restore them after it, for A/B runs and
    sweeps. ``settings`` maps ``"module.NAME"`` (see `kernel_setting`) to a value: for a dict setting, a dict of
    entries to replace (each entry whole; a key the setting lacks is an error, not a silent no-op); for a list, the
    new list; otherwise the new value. Dicts and lists change in place, because the kernel modules import them by
    name (``from .fp4_moe_configs import CONFIG``) and a rebound name would not reach them."""
    saved = []
    try:
        for key, value in settings.items():
            mod, attr = kernel_setting(key)
            current = getattr(mod, attr)
            saved.append((mod, attr, current, copy.deepcopy(current)))
            if isinstance(current, dict):
                if not isinstance(value, dict):
                    raise ValueError(f"{key} is a dict: give a dict of the entries to replace, not {value!r}.")
                unknown = set(value) - set(current)
                if unknown:
                    raise ValueError(f"{key} has no entries {sorted(unknown)}; it has {sorted(current)}.")
                current.update(value)
            elif isinstance(current, list):
                current[:] = value
            else:
                setattr(mod, attr, value)
        yield
    finally:
        for mod, attr, current, before in reversed(saved):
            if isinstance(current, dict):
                current.clear()
                current.update(before)
            elif isinstance(current, list):
                current[:] = before
            else:
                setattr(mod, attr, before)


def run_target(target: str, argv: list[str]) -> None:
    """Run another benchmark in this process as ``__main__`` with arguments ``argv`` (so that settings this process
    holds, e.g. under `override`, apply to it): a module name (``benchmarks.training.grpo_step``) or a script path."""
    sys.argv = [target, *argv]
    if target.endswith(".py") or os.sep in target:
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
