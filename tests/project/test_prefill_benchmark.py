# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`benchmarks.rollout.prefill` runs end to end in its --smoke mode (CPU, tiny model) with --profile, and its
profile parts sort kernels as documented."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.rollout import prefill


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU mode")
def test_prefill_smoke_times_both_setups_every_cell_and_profiles_them(tmp_path):
    out = tmp_path / "prefill.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.rollout.prefill", "--smoke", "--profile", "--out", str(out)],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    cells = {(c["setup"], c["rows"], c["prompt_tokens"]): c for c in res["cells"]}
    assert set(cells) == {(s, r, p) for s in ("fp4", "bf16") for r, p in ((1, 16), (2, 8))}
    for c in cells.values():
        assert c["status"] == "ok", c
        assert c["forward_ms"] > 0 and c["load_cache_ms"] > 0 and c["tokens_per_s"] > 0
        parts = c["profile"]["parts_ms"]
        assert set(parts) == set(prefill.PART_NAMES) and min(parts.values()) >= 0
        assert sum(parts.values()) == pytest.approx(c["profile"]["total_ms"], rel=1e-3, abs=1e-2)
        assert parts["routed_experts"] > 0 and parts["attention"] > 0
    assert cells[("fp4", 1, 16)]["profile"]["parts_ms"]["hint_recording"] > 0  # FP4 records hints, BF16 none
    assert cells[("bf16", 1, 16)]["profile"]["parts_ms"]["hint_recording"] == 0
    assert [(r["rows"], r["prompt_tokens"]) for r in res["table"]] == [(1, 16), (2, 8)]
    for r in res["table"]:
        assert r["fp4_over_bf16"] == pytest.approx(r["fp4_tokens_per_s"] / r["bf16_tokens_per_s"])
        assert r["fp4_over_bf16"] > 0 and r["fp4_over_bf16_with_load"] > 0
    assert "fp4/bf16" in proc.stdout and "top kernels, fp4 1x16" in proc.stdout


def test_profile_parts_sort_kernels_by_scope_then_name():
    """The hints scope wins; FP4 quantization kernels count as quantization wherever they ran; any other kernel in
    a scope is the scope's; outside scopes the name decides (first pattern), else "other"."""
    part = prefill.part_of
    assert part("_fp4_kernel", "hints") == "hint_recording"
    assert part("_fp4_kernel", "routed_experts") == "fp4_quant_kv_write"
    assert part("nvjet_sm90_tst_64x64", "routed_experts") == "routed_experts"
    assert part("void at::native::vectorized_elementwise_kernel<8>", "kv_cache_write") == "fp4_quant_kv_write"
    assert part("gate_up_kernel", None) == "routed_experts"  # a Triton launch the profiler did not link
    assert part("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", None) == "attention"
    assert part("nvjet_sm90_tst_384x64_64x3_2x1_v_bz_coopB_TNN", None) == "bf16_gemm"
    assert part("void at::native::reduce_kernel<512, 1>", None) == "norms_elementwise"
    assert part("some_unknown_kernel", None) == "other"


def test_scoped_patches_and_restores_the_classes():
    from transformers.cache_utils import DynamicLayer

    from trace_hf.hints import HintRecorder
    from trace_hf.quant.kv_cache import FP4KVLayer

    class Experts(torch.nn.Module):
        def forward(self, x):
            return x

    class Sub(Experts):  # inherits forward: the patch on it must go again, not stay as its own
        pass

    layer = lambda ex: type("L", (), {"mlp": type("M", (), {"experts": ex})()})()  # noqa: E731
    lm = type("LM", (), {"model": type("I", (), {"layers": [layer(Experts()), layer(Sub())]})()})()
    before = [DynamicLayer.update, FP4KVLayer.update, HintRecorder.record_input, Experts.forward]
    with prefill.scoped(lm):
        assert FP4KVLayer.update is not before[1] and "forward" in Sub.__dict__
        assert Sub()(torch.ones(1)).item() == 1.0
    assert [DynamicLayer.update, FP4KVLayer.update, HintRecorder.record_input, Experts.forward] == before
    assert "forward" not in Sub.__dict__


def test_event_times_attribute_gpu_kernels_to_the_scope_that_launched_them():
    """The GPU branch on stand-in profiler events: a kernel linked to an op counts in the innermost scope above
    that op; the part of a kernel's time not linked to any op counts by its name; scope annotations (CPU and GPU
    side) count nothing themselves."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    def cpu(name, parent=None, kernels=()):
        return NS(name=name, cpu_parent=parent, device_type=DeviceType.CPU,
                  kernels=[NS(name=k, duration=d) for k, d in kernels])  # fmt: skip

    def gpu(name, us, annotation=False):
        return NS(name=name, device_type=DeviceType.CUDA, is_user_annotation=annotation,
                  time_range=NS(elapsed_us=lambda: us))  # fmt: skip

    experts = cpu("prefill/routed_experts", kernels=[("prefill/routed_experts", 99.0)])
    hints = cpu("prefill/hints", parent=experts)
    events = [
        experts, hints,
        cpu("aten::mm", parent=experts, kernels=[("nvjet_sm90_tst", 10.0)]),
        cpu("aten::bitwise_and", parent=hints, kernels=[("vectorized_elementwise_kernel", 2.0)]),
        cpu("aten::mm", kernels=[("nvjet_sm90_tst", 5.0)]),
        gpu("nvjet_sm90_tst", 15.0), gpu("vectorized_elementwise_kernel", 2.0),
        gpu("gate_up_kernel", 7.0),  # a Triton launch no op is linked to
        gpu("prefill/routed_experts", 40.0, annotation=True),
    ]  # fmt: skip
    got = prefill.event_times(events, cuda=True)
    assert dict(got) == {
        ("nvjet_sm90_tst", "routed_experts"): 10.0, ("nvjet_sm90_tst", "bf16_gemm"): 5.0,
        ("vectorized_elementwise_kernel", "hint_recording"): 2.0, ("gate_up_kernel", "routed_experts"): 7.0,
    }  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU mode")
def test_a_failing_cell_is_recorded_and_the_others_go_on(tmp_path, monkeypatch):
    """An OOM in one cell is that cell's status; the other cells and setups still run; past the budget every cell
    is skipped and says so (and with nothing timed the exit code is 1)."""
    from trace_hf.rollout.engine import EngineRollout

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    real = EngineRollout._prefill

    def prefill_or_oom(lm, ids, mask, kv_fp4, record):
        if ids.shape[0] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return real(lm, ids, mask, kv_fp4, record)

    monkeypatch.setattr(EngineRollout, "_prefill", staticmethod(prefill_or_oom))
    assert prefill.main(["--smoke", "--out", str(tmp_path / "p.json")]) == 0
    res = json.loads((tmp_path / "p.json").read_text())
    status = {(c["setup"], c["rows"]): c["status"] for c in res["cells"]}
    assert status[("fp4", 1)] == status[("bf16", 1)] == "ok"
    assert status[("fp4", 2)].startswith("error: OutOfMemoryError") and status[("bf16", 2)] == status[("fp4", 2)]
    assert res["table"][1]["fp4_over_bf16"] is None and res["table"][0]["fp4_over_bf16"] > 0
    assert prefill.main(["--smoke", "--budget-s", "0", "--out", str(tmp_path / "q.json")]) == 1
    cells = json.loads((tmp_path / "q.json").read_text())["cells"]
    assert len(cells) == 4 and all(c["status"].startswith("skipped: time budget") for c in cells)
