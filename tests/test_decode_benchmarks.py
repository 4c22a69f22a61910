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


def _run(script: str, out: Path, runner: tuple[str, ...] = ()) -> tuple[dict, str]:
    """Run a benchmark in its --smoke mode (behind ``runner``, a wrapper script and its arguments): its JSON, stdout."""
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, *runner, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(out)],
        cwd=str(out.parent), env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU mode")
def test_rollout_decode_smoke(tmp_path):
    res, _ = _run("rollout_decode.py", tmp_path / "rollout.json")
    cells = {(c["setup"], c["batch"]): c for c in res["cells"]}
    for setup in ("hf", "fast_bf16", "fast_fp4"):
        for b in (1, 2):
            assert cells[(setup, b)]["status"] == "ok", cells[(setup, b)]
    fp4 = cells[("fast_fp4", 2)]
    assert "hint_overhead" in fp4 and fp4["bytes"]["experts"] < cells[("fast_bf16", 2)]["bytes"]["experts"]
    assert len(res["table"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU mode")
def test_train_step_smoke(tmp_path):
    res, _ = _run("train_step.py", tmp_path / "train.json")
    assert res["ratio"] > 0 and res["bf16_step_s"] > 0 and res["qat_step_s"] > 0 and res["qat_uncached_step_s"] > 0
    assert res["weight_cache_gib"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU mode")
def test_block_t_runner_sets_the_table_and_runs_the_script(tmp_path):
    """`benchmarks/with_hopper_block_t.py` (the 16-token-block experiment of docs/benchmarks.md 2d) from another
    directory: the table it runs with, and the wrapped benchmark's result."""
    runner = (str(ROOT / "benchmarks" / "with_hopper_block_t.py"), "16")
    res, stdout = _run("train_step.py", tmp_path / "train.json", runner)
    table = next(line for line in stdout.splitlines() if line.startswith("HOPPER:"))
    assert "'block_t': 16" in table and "'block_t': 8" in table  # batch 1's entry keeps its 8-token blocks
    assert res["qat_step_s"] > 0


def test_ncu_summary_reads_units_and_stalls(tmp_path):
    """`benchmarks/ncu_summary.py` on an ncu ``--page raw --csv`` export: durations and bytes are converted from the
    units ncu chose (us, Mbyte), and the stall reasons come out largest first."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import ncu_summary
    finally:
        sys.path.pop(0)
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    cols = {
        "Kernel Name": ("", "gate_up_kernel(int, int)"),
        "gpu__time_duration.sum": ("us", "96.384"),
        "dram__bytes_read.sum": ("Mbyte", "225.05"),
        "smsp__inst_executed.sum": ("inst", "45,944,256"),
        stall.format("long_scoreboard"): ("", "0.93"),
        stall.format("wait"): ("", "0.59"),
        stall.format("selected"): ("", "1"),
    }
    path = tmp_path / "k.raw.csv"
    path.write_text(
        "\n".join(",".join(f'"{v}"' for v in row) for row in zip(*[(k, u, v) for k, (u, v) in cols.items()])) + "\n"
    )
    (rec,) = ncu_summary.summarize(str(path))
    assert rec["kernel"] == "gate_up_kernel" and rec["us"] == pytest.approx(96.384)
    assert rec["dram_mb"] == pytest.approx(225.05) and rec["warp_inst_m"] == pytest.approx(45.944, abs=1e-3)
    assert list(rec["stalls"]) == ["selected", "long_scoreboard", "wait"]


def test_hopper_ab_patches_name_what_they_change():
    """`benchmarks/hopper_ab.py`'s patches: slot limits of `HOPPER`, and settings dicts of the kernel modules merged
    key by key; a key that names nothing is an error, not a variant that silently measures the base."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import hopper_ab
    finally:
        sys.path.pop(0)
    table = [(8, {"block_t": 8, "split_k": 4}), (256, {"block_t": 8})]
    got = hopper_ab.patched(table, {"*": {"block_t": 16}, "8": {"split_k": 2}, "fp4_quant.CONFIG": {}})
    assert got == [(8, {"block_t": 16, "split_k": 2}), (256, {"block_t": 16})]
    with pytest.raises(SystemExit, match="slot limits"):
        hopper_ab.patched(table, {"16": {"block_t": 16}})
    base = {"fp4": {"block_t": 128}, "hopper": {"block_t": 64, "target_programs": 1056}, "ptx": True}
    assert hopper_ab.merged(base, {"hopper": {"target_programs": 1584}, "ptx": False}) == {
        "fp4": {"block_t": 128}, "hopper": {"block_t": 64, "target_programs": 1584}, "ptx": False,
    }  # fmt: skip
    with pytest.raises(SystemExit, match="do not have"):
        hopper_ab.merged(base, {"hopper": {"target_program": 1584}})
    with pytest.raises(SystemExit, match="no settings dict"):
        hopper_ab.settings_dicts({"v": {"fp4_moe_configs.NOT_A_SETTING": {}}})
    (mod, attr, saved) = hopper_ab.settings_dicts({"v": {"fp4_moe_configs.HIDDEN_LAUNCH": {"rows": 2}}})[
        "fp4_moe_configs.HIDDEN_LAUNCH"
    ]
    assert saved == mod.HIDDEN_LAUNCH and saved is not mod.HIDDEN_LAUNCH
    dicts = hopper_ab.settings_dicts({"v": {"fp4_moe_configs.HIDDEN_LAUNCH": {"rows": 2}}})
    launch = mod.HIDDEN_LAUNCH
    try:
        hopper_ab.apply(dicts, {"fp4_moe_configs.HIDDEN_LAUNCH": {"rows": 2}})
        assert launch == {**saved, "rows": 2}  # in place: the kernels read the module's dict
    finally:
        hopper_ab.apply(dicts, {})
    assert launch == saved
