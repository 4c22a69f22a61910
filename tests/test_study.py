# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""examples/study/study.py end to end at --size tiny: warm, GRPO with the evaluation and time-budget callbacks
(one all-sites regime), seeds kept apart and averaged, and the report's table, summary and plots."""

import importlib.util
import json
import os

import pytest

from trace_hf import hint_bytes_per_token


pytestmark = pytest.mark.usefixtures("one_thread")
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--size", "tiny", "--prompts-per-step", "2", "--num-generations", "2", "--max-completion-length", "12",
         "--eval-problems", "4"]  # fmt: skip


@pytest.fixture(scope="module")
def study():
    path = os.path.join(PROJECT_ROOT, "examples", "study", "study.py")
    spec = importlib.util.spec_from_file_location("study_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_regimes_and_hint_bytes_from_configs(study):
    assert {"all_sites", "all_sites_replay", "all_sites_h100"} <= set(study.REGIMES)
    assert study.REGIMES["all_sites_h100"] == (True, True, True, True, 1.0, study.ALL_SITES)
    qwen = study.qwen35_35b_config()
    # docs/numerics.md, hints section: the paper's setting, all sites on the last 20 and on all 40 MoE layers.
    assert [study.hint_bytes(r, qwen) for r in ("trace", "all_sites", "all_sites_h100", "fp4_qat", "bf16")] == [
        7760, 24800, 49600, 0, 0,
    ]  # fmt: skip


def test_warm_grpo_report(study, tmp_path):
    out = str(tmp_path)
    study.main(["warm", "--out", out, "--sft-steps", "2", *SMALL])
    for seed in ("0", "1"):
        study.main(["grpo", "--out", out, "--regime", "bf16", "--steps", "2", "--eval-every", "1", "--seed", seed,
                    *SMALL])  # fmt: skip
    # A budget no step fits in: the run stops after its first step and still writes its result.
    study.main(["grpo", "--out", out, "--regime", "all_sites_replay", "--steps", "5", "--eval-every", "2",
                "--max-train-seconds", "0.001", *SMALL])  # fmt: skip
    study.main(["report", "--out", out])

    results = study.load_results(out)
    assert list(results) == ["bf16", "all_sites_replay"] and [r["seed"] for r in results["bf16"]] == [0, 1]
    for r in results["bf16"]:
        assert (r["steps_done"], r["stopped_by_budget"], r["hint_bytes_per_token"]) == (2, False, 0)
        assert [h["step"] for h in r["history"] if "eval/test_accuracy" in h] == [0, 1, 2]
    (r,) = results["all_sites_replay"]
    assert (r["steps_done"], r["stopped_by_budget"]) == (1, True)
    assert [h["step"] for h in r["history"] if "eval/test_accuracy" in h] == [0, 1]  # before and after training
    config = study.model_config("tiny", None)
    expected = hint_bytes_per_token(config, hint_layers=2, sites=study.ALL_SITES)
    logged = [h["trace/hint_bytes_per_token"] for h in r["history"] if "reward" in h]
    assert r["hint_bytes_per_token"] == expected == logged[0] > 0  # from the config == what the rollout recorded
    assert r["hint_bytes_per_token_qwen35_35b"] == 24800
    assert {k for h in r["history"] for k in h if k.startswith("trace/hint_flip_rate/")} == {
        f"trace/hint_flip_rate/{s}" for s in study.ALL_SITES
    }

    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["bf16"]["seeds"] == [0, 1] and summary["bf16"]["hint_bytes_per_token"] == 0
    assert summary["all_sites_replay"]["flip_rate_by_site"].keys() == set(study.ALL_SITES)
    assert summary["all_sites_replay"]["kl"] is not None and summary["bf16"]["eval_last"] is not None
    with open(os.path.join(out, "table.md")) as f:
        table = f.read()
    assert "flip experts_hidden" in table and "hint B/token (Qwen3.5-35B-A3B)" in table
    assert "| all_sites_replay | 1 | 1 |" in table and "| 24,800 |" in table and "| bf16 | 2 | 2 |" in table
    for png in ("study.png", "kl_vs_bytes.png", "curves.png"):
        assert os.path.getsize(os.path.join(out, png)) > 10_000
