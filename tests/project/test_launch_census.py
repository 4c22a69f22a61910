# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`benchmarks.training.launch_census` (CPU, interpreter, the GPU's dispatch): per-layer counts that do not depend on
the depth they are taken at, Triton launches only where trace-hf's FP4 path makes them, each launch with its source."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parents[2]


def census(tmp_path, layers: int) -> dict:
    out = tmp_path / f"census_{layers}.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.training.launch_census", "--layers", str(layers), "--tokens", "24",
         "--out", str(out)],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())["results"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the census runs on the CPU, under the interpreter")
def test_launches_per_layer_are_counted_the_same_at_any_depth(tmp_path):
    a, b = census(tmp_path, 1), census(tmp_path, 2)
    for setup in ("bf16", "fp4"):
        for phase in ("no_grad_forward", "forward_backward"):
            x, y = a[setup][phase], b[setup][phase]
            assert x["aten_per_layer"] == y["aten_per_layer"] > 0, (setup, phase)
            assert x["triton_per_layer"] == y["triton_per_layer"], (setup, phase)
            assert sum(v for _, v in x["sources_per_layer"]) == x["aten_per_layer"]  # every launch has its source
            # No host sync inside a layer (the precondition for capturing one in a CUDA graph); use_hints' and the
            # model's own, once per forward, are seen.
            assert x["syncs_per_layer"] == y["syncs_per_layer"] == [], (setup, phase)
    assert sum(a["fp4"]["no_grad_forward"]["syncs_whole_forward"].values()) > 0
    # BF16 runs only the trainer's fused glue: 4 RMSNorms (input, post-attention, q, k) and the rotary of q and k.
    assert a["bf16"]["no_grad_forward"]["triton_per_layer"] == 4 + 2
    fp4 = a["fp4"]["no_grad_forward"]
    assert fp4["triton_per_layer"] >= 6 + 2  # and at least the experts' gate/up and down kernels
    assert any(src.startswith("trace_hf/hints/") for src, _ in fp4["sources_per_layer"])  # routing replay's hooks


@pytest.mark.skipif(torch.cuda.is_available(), reason="the census runs on the CPU, under the interpreter")
def test_qwen35_census_takes_the_trainers_cuda_paths(tmp_path):
    """``--shape tiny_qwen35`` (Qwen3.5's layer types at the smoke size): per layer of a whole period (3 Gated DeltaNet layers and 1 attention layer), with the
    trainer's defaults on CUDA: the recurrent values from the kernel (no torch loop over tokens) in every forward, its
    backward kernel where a gradient is taken (no chunked form at all), and the fused norms."""
    out = tmp_path / "q35.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.training.launch_census", "--shape", "tiny_qwen35", "--layers", "4",
         "--tokens", "16", "--setups", "fp4", "--out", str(out)],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["layers"] == [4, 8]
    fp4 = data["results"]["fp4"]
    for phase, r in fp4.items():
        sources = dict(r["sources_per_layer"])
        assert sum(sources.values()) == r["aten_per_layer"] > 0, phase
        assert not any("torch_recurrent_gated_delta_rule" in s for s in sources), phase  # the kernel, not the loop
        assert any(s.startswith("kernels/gated_delta_recurrent.py") for s in sources), phase
        assert "torch_chunk_gated_delta_rule" not in str(sources), phase  # its gradient is the kernel's too
        assert r["triton_per_layer"] > 0
        assert r["syncs_per_layer"] == [], phase
