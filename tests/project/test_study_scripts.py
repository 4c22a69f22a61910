# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The study's device scripts (examples/study/run_study_h200.sh, run_long_h200.sh) on stubs of ``nvidia-smi`` (two
GPUs) and python: the warm-up once, then every (regime, seed) of SEEDS x REGIMES launched once, spread round-robin
over the GPUs, each with the script's arguments, then the report."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not (shutil.which("bash") and shutil.which("timeout")), reason="needs bash")


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _run(tmp_path: Path, script: str, **env: str) -> tuple[list[tuple[str, list[str]]], str]:
    """The script's python calls ((CUDA_VISIBLE_DEVICES, arguments), in the order they were made) and its stdout."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    _stub(bin_dir / "nvidia-smi", 'if [ "$1" = -L ]; then echo "GPU 0: stub"; echo "GPU 1: stub"; fi\n')
    _stub(bin_dir / "py", f'echo "${{CUDA_VISIBLE_DEVICES:-}}|$*" >> {log}\necho "stub $1 $2"\n')
    full = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PY": str(bin_dir / "py"),
            "OUT": str(tmp_path / "out"), "BUDGET_S": "1000", "MPS": "0", **env}  # fmt: skip
    proc = subprocess.run(["bash", f"examples/study/{script}"], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    calls = [line.split("|", 1) for line in log.read_text().splitlines()]
    return [(gpu, args.split()) for gpu, args in calls], proc.stdout


def _grpo_runs(calls) -> dict:
    """(regime, seed) -> (GPU, arguments) of each ``study.py grpo`` call."""
    runs = {}
    for gpu, args in calls:
        if args[:2] == ["examples/study/study.py", "grpo"]:
            key = (args[args.index("--regime") + 1], args[args.index("--seed") + 1])
            assert key not in runs, f"{key} launched twice"
            runs[key] = (gpu, args)
    return runs


@pytest.mark.parametrize("script", ["run_long_h200.sh", "run_study_h200.sh"])
def test_every_regime_and_seed_runs_once_round_robin_over_the_gpus(tmp_path, script):
    regimes, seeds = ["bf16", "fp4_qat", "trace_replay"], ["0", "1"]
    calls, stdout = _run(tmp_path, script, SEEDS=" ".join(seeds), REGIMES=" ".join(regimes), STEPS="7",
                         STUDY_ARGS="--size tiny")  # fmt: skip
    stages = [args[1] for _, args in calls if args[0] == "examples/study/study.py"]
    assert stages[0] == "warm" and stages[-1] == "report" and stages.count("warm") == 1
    runs = _grpo_runs(calls)
    order = [(r, s) for s in seeds for r in regimes]
    assert set(runs) == set(order)
    for i, key in enumerate(order):
        gpu, args = runs[key]
        assert gpu == str(i % 2), (key, gpu)
        assert args[args.index("--steps") + 1] == "7" and args[-2:] == ["--size", "tiny"]  # STUDY_ARGS last
        assert f"{key[0]} seed {key[1]} rc=0" in stdout
    if script == "run_study_h200.sh":  # the runs meet at one common step: each is told how many there are
        assert all(args[args.index("--sync-runs") + 1] == str(len(order)) for _, args in runs.values())
    else:
        assert all("--max-train-seconds" in args for _, args in runs.values())
