# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Token counts passed unspecialized cost the kernels nothing that matters: compiled for sm_90 (no GPU needed), each
training-side kernel has the same memory and MMA instructions whether its counts are 16-divisible or not, within a
few percent of instructions (`benchmarks.kernels.count_specialization`)."""

from __future__ import annotations

import os

import pytest


def test_unspecialized_counts_keep_the_kernels_memory_instructions():
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this Triton has no bundled ptxas")
    from benchmarks.kernels import sass_counts

    rows = sass_counts.clean_python(
        "import json; from benchmarks.kernels import count_specialization as c; print(json.dumps(c.compare()))"
    )
    assert {r["kernel"].split(",")[0] for r in rows} >= {
        "fp4_moe_grouped._grouped_gemm_kernel",
        "fp4_quant._fp4_kernel",
    }
    for r in rows:
        assert r["instructions_unspecialized"] <= 1.05 * r["instructions_16_divisible"], r
        if "rms_norm._backward" not in r["kernel"]:  # its rows' rstd: two 32-bit loads instead of one 64-bit load
            assert r["memory_unspecialized"] == r["memory_16_divisible"], r
        if "grouped_gemm" in r["kernel"]:
            assert any(k.startswith("HGMMA") for k in r["memory_unspecialized"]), r
