# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The BF16 pilot of issue 54 (docs/results.md section 8): the carry task (trace_hf.data.carry_dataset), the
registered gate and collapse rules (examples/study/pilot.py), and the device script's stages on stubs."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
_COLUMN = re.compile(r"^(\d)\+(\d)(\+1)?=(\d+), (\d+)$")


@pytest.fixture(scope="module")
def pilot():
    spec = importlib.util.spec_from_file_location("pilot_example", ROOT / "examples" / "study" / "pilot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_carry_worked_answer_examples():
    from trace_hf.data import carry_worked_answer

    assert carry_worked_answer(4738, 2965) == "8+5=13, 3\n3+6+1=10, 03\n7+9+1=17, 703\n4+2+1=7, 7703\n#### 7703"
    assert carry_worked_answer(999, 1) == "9+1=10, 0\n9+0+1=10, 00\n9+0+1=10, 1000\n#### 1000"  # shorter operand: 0s
    assert carry_worked_answer(12, 34) == "2+4=6, 6\n1+3=4, 46\n#### 46"  # no carry, no "+1"
    with pytest.raises(ValueError, match="non-negative"):
        carry_worked_answer(-1, 3)


def test_carry_dataset_is_seeded_disjoint_and_every_column_is_right():
    from trace_hf.data import carry_dataset, exact_answer_reward, extract_final_number

    ds = carry_dataset(n_train=400, n_test=60, seed=5, min_digits=3, max_digits=5)
    assert (len(ds["train"]), len(ds["test"])) == (400, 60)
    again, other = (
        carry_dataset(n_train=400, n_test=60, seed=5, min_digits=3, max_digits=5),
        carry_dataset(n_train=400, n_test=60, seed=6, min_digits=3, max_digits=5),
    )
    assert list(again["train"]["answer"]) == list(ds["train"]["answer"])
    assert list(again["test"]["question"]) == list(ds["test"]["question"])
    assert list(other["test"]["question"]) != list(ds["test"]["question"])
    assert not set(ds["train"]["question"]) & set(ds["test"]["question"])  # no test problem is trained on
    digits, carries = {3: 0, 4: 0, 5: 0}, 0
    for split in ("train", "test"):
        for q, a in zip(ds[split]["question"], ds[split]["answer"], strict=True):
            x, y = q.split("+")
            assert len(x) == len(y) and x[0] != "0" and y[0] != "0"
            digits[len(x)] += 1
            *lines, final = a.split("\n")
            assert final == f"#### {int(x) + int(y)}" and extract_final_number(a) == str(int(x) + int(y))
            assert len(lines) == len(x)  # one line per column
            carry, result = 0, ""
            for i, line in enumerate(lines):  # column i from the ones up: its digits, carry in, sum, result so far
                m = _COLUMN.match(line)
                assert m, line
                dx, dy, plus_one, total, so_far = m.groups()
                assert (int(dx), int(dy)) == (int(x[-1 - i]), int(y[-1 - i]))
                assert bool(plus_one) == bool(carry) and int(total) == int(dx) + int(dy) + carry
                carries += bool(plus_one)
                result = (total if i == len(lines) - 1 else str(int(total) % 10)) + result
                assert so_far == result
                carry = int(total) // 10
            assert int(result) == int(x) + int(y)
            assert exact_answer_reward([" " + a], [a]) == [1.0]  # the reference scores 1 as a completion
    assert min(digits.values()) > 50 and carries > 400  # every width occurs; carries are common
    with pytest.raises(ValueError, match="min_digits <= max_digits"):
        carry_dataset(min_digits=4, max_digits=3)


def test_study_carry_task_is_four_digits(study):
    train, test = study.data("carry", "pilot")
    assert len(test) == 512 and len(train) == 32768
    assert {len(q.split("+")[0]) for q in test["question"]} == {4}
    assert test[0]["prompt"] == f"Q: {test[0]['question']}\nA:"
    assert study.reward_of("carry").__name__ == "exact_answer_reward"


def _rows(pilot, gains_by_lr, warm=0.3):
    return [
        {"learning_rate": lr, "out": f"lr{lr}", "warm": warm, "final_per_seed": [warm + g for g in gains],
         "gain": sum(gains) / len(gains), "se": pilot.study.mean_se(gains)[1],
         "opens": len(gains) >= 2 and sum(gains) / len(gains) >= pilot.GATE_GAIN
         and sum(gains) / len(gains) > 2 * pilot.study.mean_se(gains)[1]}
        for lr, gains in gains_by_lr.items()
    ]  # fmt: skip


def test_gate_opens_on_the_largest_qualifying_gain_and_names_the_stable_edge(pilot):
    rows = _rows(pilot, {1e-4: [0.12, 0.15, 0.13], 3e-4: [0.20, 0.25, 0.22], 1e-3: [-0.2, -0.25, -0.1]})
    g = pilot.gate_of(rows)
    assert g["open"] and g["learning_rate"] == 3e-4 and g["winner_out"] == "lr0.0003"
    assert g["edge_learning_rate"] == 3e-4  # 1e-3 ended more than 0.05 below the warm start
    # +0.09 is under the registered +0.10; +0.2 with a huge spread is not more than 2 SE.
    closed = pilot.gate_of(_rows(pilot, {1e-4: [0.09, 0.09, 0.09], 3e-4: [0.6, -0.2, 0.2]}))
    assert not closed["open"] and closed["learning_rate"] is None
    assert closed["edge_learning_rate"] == 1e-4  # 3e-4 has a seed 0.2 below the start


def test_collapse_steps(pilot):
    start = 0.30
    evals = [(0, 0.30), (50, 0.31), (100, 0.20), (150, 0.32), (200, 0.22), (250, 0.10), (300, 0.05)]
    assert pilot.collapse_step(evals, start) == 200  # below from 200 on (the dip at 100 recovered)
    assert pilot.collapse_step(evals[:-2], start) is None  # one evaluation below is not "stays there"
    assert pilot.collapse_step([(0, 0.3), (50, 0.28), (100, 0.26)], start) is None  # within 0.05 of the start
    steps = list(range(1, 201))
    flat = [0.4] * 200
    assert pilot.reward_collapse_step(steps, flat) is None
    fall = [0.4] * 100 + [0.1] * 100
    hit = pilot.reward_collapse_step(steps, fall)
    assert hit is not None and 100 < hit <= 125  # the trailing mean crosses 0.35 a few steps after the fall
    assert pilot.reward_collapse_step(steps, [0.4] * 190 + [0.0] * 10) is None  # not held for a window


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.skipif(not (shutil.which("bash") and shutil.which("timeout")), reason="needs bash")
@pytest.mark.parametrize("gate_open", [True, False])
def test_pilot_script_runs_the_regimes_only_when_the_gate_opens(tmp_path, gate_open):
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    _stub(bin_dir / "nvidia-smi", 'if [ "$1" = -L ]; then echo "GPU 0: stub"; fi\n')
    gate = {"open": gate_open, "learning_rate": 1e-4 if gate_open else None, "edge_learning_rate": 3e-4}
    # python -c (the script's own one-liners) runs for real; study.py / pilot.py calls are logged; `gate` writes the
    # gate file it is given and exits as the real one does.
    _stub(bin_dir / "py", f"""if [ "$1" = -c ]; then exec python3 "$@"; fi
echo "$*" >> {log}
if [ "$2" = gate ]; then
  while [ $# -gt 0 ]; do if [ "$1" = --gate-json ]; then echo '{json.dumps(gate)}' > "$2"; fi; shift; done
  exit {0 if gate_open else 3}
fi
echo "stub"
""")  # fmt: skip
    warm = tmp_path / "warm_from"
    (warm / "warm").mkdir(parents=True)
    (warm / "warm.json").write_text("{}")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PY": str(bin_dir / "py"),
           "OUT": str(tmp_path / "out"), "BUDGET_S": "1000", "MPS": "0", "WARM_FROM": str(warm),
           "LRS": "1e-4 3e-4", "SEEDS": "0 1", "REGIMES": "bf16 trace_replay", "STEPS": "9"}  # fmt: skip
    proc = subprocess.run(["bash", "examples/study/run_pilot_h200.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    calls = [line.split() for line in log.read_text().splitlines()]
    stages = [c[1] for c in calls]
    assert stages[0] == "measure"
    grpo = [c for c in calls if c[1] == "grpo"]

    def arg(c, name):
        return c[c.index(name) + 1]

    pilot_runs = [c for c in grpo if "/pilot/" in arg(c, "--out")]
    assert sorted((arg(c, "--learning-rate"), arg(c, "--seed")) for c in pilot_runs) == [
        ("1e-4", "0"), ("1e-4", "1"), ("3e-4", "0"), ("3e-4", "1")]  # fmt: skip
    assert {arg(c, "--regime") for c in pilot_runs} == {"bf16"}
    assert {arg(c, "--sync-runs") for c in pilot_runs} == {"4"}
    assert len({arg(c, "--sync-name") for c in pilot_runs}) == 4  # unique names: one common step for all rates
    assert all(arg(c, "--steps") == "9" and arg(c, "--task") == "carry" and arg(c, "--size") == "pilot" for c in grpo)
    assert stages.index("gate") > max(i for i, c in enumerate(calls) if c in pilot_runs)
    regime_runs = [c for c in grpo if c not in pilot_runs]
    if gate_open:
        assert sorted((arg(c, "--regime"), arg(c, "--seed")) for c in regime_runs) == [
            ("bf16", "0"), ("bf16", "1"), ("trace_replay", "0"), ("trace_replay", "1")]  # fmt: skip
        assert {arg(c, "--learning-rate") for c in regime_runs} == {"0.0001"}  # the winner
        assert {arg(c, "--sync-runs") for c in regime_runs} == {"4"}
        assert stages[-1] == "report"
    else:
        assert regime_runs == [] and "gate closed" in proc.stdout
    assert (tmp_path / "out" / "gate.json").exists() and (tmp_path / "out" / "study.tar.gz").exists()
