# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The rollout-decode and train-step benchmarks run end to end in their --smoke mode (CPU, tiny shapes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, out: Path) -> dict:
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(out)],
        cwd=str(out.parent), env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU mode")
def test_rollout_decode_smoke(tmp_path):
    res = _run("rollout_decode.py", tmp_path / "rollout.json")
    cells = {(c["setup"], c["batch"]): c for c in res["cells"]}
    for setup in ("hf", "fast_bf16", "fast_fp4"):
        for b in (1, 2):
            assert cells[(setup, b)]["status"] == "ok", cells[(setup, b)]
    fp4 = cells[("fast_fp4", 2)]
    assert "hint_overhead" in fp4 and fp4["bytes"]["experts"] < cells[("fast_bf16", 2)]["bytes"]["experts"]
    assert len(res["table"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU mode")
def test_train_step_smoke(tmp_path):
    res = _run("train_step.py", tmp_path / "train.json")
    assert res["ratio"] > 0 and res["bf16_step_s"] > 0 and res["qat_step_s"] > 0 and res["qat_uncached_step_s"] > 0
    assert res["weight_cache_gib"] > 0
