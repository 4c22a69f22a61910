# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`benchmarks.kernels.gluon_launches` records the Gluon expert kernels' launches on CPU, for both backends, and its
comparison catches a changed argument or keyword (what it is for: host-side refactors checked without a GPU)."""

import copy
import subprocess
import sys

import torch

from benchmarks.kernels import gluon_launches as G


def test_records_both_gluon_backends_and_compare_catches_a_change(tmp_path):
    out = tmp_path / "head.pt"
    root = G.__file__.rsplit("/benchmarks/", 1)[0]
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels.gluon_launches", "--root", root, "--out", str(out)],
        cwd=root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    rec = torch.load(out, weights_only=False)
    names = {name for _, _, launches in rec for name, *_ in launches}
    assert {"fp4_moe_hopper.gate_up_kernel", "fp4_moe_hopper.down_kernel"} <= names
    assert {"fp4_moe_wgmma.gate_up_kernel", "fp4_moe_wgmma.down_kernel"} <= names
    assert G.compare(rec, rec) == []
    changed = copy.deepcopy(rec)
    name, grid, args, kwargs = changed[0][2][0]
    changed[0][2][0] = (name, grid, args, {**kwargs, "num_warps": kwargs["num_warps"] * 2})
    name, grid, args, kwargs = changed[-1][2][-1]
    tensor = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.numel() and a.is_contiguous())
    args = list(args)
    args[tensor] = (args[tensor].view(torch.uint8) ^ 1).view(args[tensor].dtype)  # every byte's lowest bit
    changed[-1][2][-1] = (name, grid, tuple(args), kwargs)
    diffs = G.compare(rec, changed)
    assert len(diffs) == 2 and "num_warps" in diffs[0] and f"args [{tensor}]" in diffs[1], diffs
