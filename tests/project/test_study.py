# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""examples/study/study.py end to end at --size tiny: warm, GRPO with the evaluation and time-budget callbacks
(one all-sites regime), seeds kept apart and averaged, and the report's table, summary and plots."""

import json
import math
import os
import re
import time

import pytest

from trace_hf import hint_bytes_per_token


pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = ["--size", "tiny", "--prompts-per-step", "2", "--num-generations", "2", "--max-completion-length", "12",
         "--eval-problems", "4"]  # fmt: skip


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


# ----------------------------------------------------------------------------------------------------------
# The task with headroom: chained word problems, the strict reward, the outcome rules
# ----------------------------------------------------------------------------------------------------------

_LINE = re.compile(r"(\d+)([+\-*])(\d+)=(\d+)")


def test_chain_dataset_is_seeded_and_its_worked_answers_are_right():
    from trace_hf.data import chain_dataset, extract_final_number

    ds = chain_dataset(n_train=300, n_test=40, seed=3, min_ops=2, max_ops=4)
    assert (len(ds["train"]), len(ds["test"])) == (300, 40)
    again, other = chain_dataset(n_train=300, n_test=40, seed=3), chain_dataset(n_train=300, n_test=40, seed=4)
    assert list(again["train"]["answer"]) == list(ds["train"]["answer"])
    assert list(again["test"]["question"]) == list(ds["test"]["question"])
    assert list(other["train"]["answer"]) != list(ds["train"]["answer"])
    ops = {2: 0, 3: 0, 4: 0}
    rows = [(row["question"], row["answer"]) for split in ("train", "test") for row in ds[split]]
    for q, a in rows:
        *lines, final = a.split("\n")
        value = int(re.match(r"\w+ has (\d+) ", q).group(1))  # the start count
        for line in lines:
            sums = _LINE.findall(line)
            assert sums, line
            for x, op, y, z in sums:  # every written computation is right
                assert int(z) == {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op], line
            x, op, y, z = sums[-1]
            assert int(x) == value, (q, a)  # each line continues from the running total
            value = int(z)
            assert 0 < value <= 199
        assert final == f"#### {value}" and extract_final_number(a) == str(value)
        assert len(lines) == q.count(".") - 1  # one worked line per operation sentence
        ops[len(lines)] += 1
        assert 30 <= len(a) <= 150
    assert min(ops.values()) > 50  # 2, 3 and 4 operations all occur
    with pytest.raises(ValueError, match="min_ops <= max_ops"):
        chain_dataset(min_ops=3, max_ops=2)


def test_exact_answer_reward_right_wrong_malformed():
    from trace_hf.data import exact_answer_reward

    ref = "finds 3: 4+3=7\ndoubles: 7*2=14\n#### 14"
    cases = {
        ref: 1.0,  # the reference itself
        " finds 3: 4+3=7\n#### 14\n": 1.0,  # trailing whitespace is fine
        "#### 1,4": 0.0,
        "finds 3: 4+3=7\ndoubles: 7*2=15\n#### 15": 0.0,  # wrong
        "finds 3: 4+3=7\ndoubles: 7*2=14": 0.0,  # malformed: right last number, no #### line (cut off)
        "the answer is #### 14": 0.0,  # the marker must start its line
        "#### 14 apples": 0.0,
        "#### \n14": 0.0,
        "": 0.0,
        "#### 14\n#### 15": 1.0,  # the first #### line counts
        "#### 15\n#### 14": 0.0,
    }
    assert exact_answer_reward(list(cases), [ref] * len(cases)) == list(cases.values())
    assert exact_answer_reward(["#### 1,234"], ["#### 1234"]) == [1.0]
    assert exact_answer_reward([[{"role": "assistant", "content": "#### 14"}]], [ref]) == [1.0]  # conversational


def test_degradation_rule_and_outcomes(study):
    steps = list(range(1, 301))
    flat = [0.5] * 300
    assert study.degradation_step(steps, flat) is None
    drop = [0.5] * 100 + [0.3] * 200  # the trailing 25-step mean falls 0.1 below 0.5 at step 113
    assert study.degradation_step(steps, drop) == 113
    blip = [0.5] * 100 + [0.2] * 30 + [0.5] * 170  # below for fewer than 50 steps: not a degradation
    assert study.degradation_step(steps, blip) is None

    def run(regime, seed, fp4, bf16):
        return {"regime": regime, "seed": seed, "test_accuracy_fp4": fp4, "test_accuracy_bf16": bf16,
                "warm_test_accuracy": 0.3}  # fmt: skip

    results = {
        "bf16": [run("bf16", s, 0.40 + d, 0.50 + d) for s, d in enumerate((0.0, 0.01, -0.01))],
        "trace_replay": [run("trace_replay", s, 0.49 + d, 0.5) for s, d in enumerate((0.0, 0.02, -0.02))],
    }
    rows = {o["claim"]: o for o in study.outcomes(results)}
    learn, match, ptq = (rows[c] for c in (study.COMPARISONS[0][0], "TRACE vs BF16", study.COMPARISONS[6][0]))
    assert (
        learn["verdict"] == "separate"
        and learn["diff"] == pytest.approx(0.2)
        and learn["se"] == pytest.approx(0.01 / 3**0.5)
    )
    assert match["verdict"] == "no separation" and match["diff"] == pytest.approx(-0.01)
    assert ptq["verdict"] == "separate" and ptq["diff"] == pytest.approx(0.09)
    assert "TRACE vs QAT without hints" not in rows  # fp4_qat has no runs


def test_chain_task_warm_grpo_report(study, tmp_path):
    out = str(tmp_path)
    chain = ["--task", "chain", *SMALL]
    # A target every model reaches: SFT stops at its first check (step 1) and says so.
    study.main(["warm", "--out", out, "--sft-steps", "5", "--target-accuracy", "0", "--sft-eval-every", "1", *chain])
    with open(os.path.join(out, "warm.json")) as f:
        warm = json.load(f)
    assert (warm["task"], warm["sft_steps"], [c["step"] for c in warm["checks"]]) == ("chain", 1, [1])
    with pytest.raises(SystemExit, match="--task chain"):
        study.main(["grpo", "--out", out, "--regime", "bf16", "--steps", "1", *SMALL])  # the word task's default
    for regime, seed in [("bf16", 0), ("bf16", 1), ("trace_replay", 0)]:
        study.main(["grpo", "--out", out, "--regime", regime, "--steps", "1", "--seed", str(seed), *chain])
    study.main(["report", "--out", out])
    results = study.load_results(out)
    assert all(r["task"] == "chain" and r["warm_test_accuracy"] == warm["test_accuracy_bf16"]
               for runs in results.values() for r in runs)  # fmt: skip
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["bf16"]["degraded_at"] == [None, None] and len(summary["bf16"]["test_accuracy_fp4_per_seed"]) == 2
    assert {o["claim"] for o in summary["outcomes"]} >= {"TRACE vs BF16", study.COMPARISONS[6][0]}
    with open(os.path.join(out, "table.md")) as f:
        table = f.read()
    assert "| TRACE vs BF16 | trace_replay test_accuracy_fp4 | bf16 test_accuracy_bf16 |" in table
    assert "final acc, FP4 inference" in table and "degraded at step (per seed)" in table


def test_equal_steps_ends_every_run_at_one_step(study, tmp_path):
    from types import SimpleNamespace

    def step(cb, n, max_steps=500):
        state, control = (
            SimpleNamespace(global_step=n, max_steps=max_steps),
            SimpleNamespace(should_training_stop=False),
        )
        cb.on_step_end(None, state, control)
        return control.should_training_stop

    sync = str(tmp_path / "sync")
    late = study.EqualSteps(sync, "a", runs=2, deadline=0.0)  # a deadline long past: nobody expects more steps
    first = study.EqualSteps(sync, "b", runs=2, deadline=0.0)
    for cb in (late, first):
        cb.on_train_begin(None, None, None)
    assert not step(late, 1)  # one of the two runs has written its expectation: no common step yet
    assert step(first, 1) and first.target == 1  # both have: the first to reach the lowest expectation sets it
    assert step(late, 2) and late.target == 1  # the other reads it and stops at once (it is past it)
    crashed = tmp_path / "stale"
    crashed.mkdir()
    (crashed / "dead.expect").write_text("1")  # a run that crashed at step 1, long ago
    os.utime(crashed / "dead.expect", (time.time() - 600, time.time() - 600))
    alive = study.EqualSteps(str(crashed), "alive", runs=2, deadline=time.time() + 3600)
    alive.on_train_begin(None, None, None)
    assert not any(step(alive, n) for n in (1, 2, 3)) and alive.target is None  # its stale 1 is ignored
    roomy = study.EqualSteps(str(tmp_path / "roomy"), "c", runs=1, deadline=time.time() + 3600)
    roomy.on_train_begin(None, None, None)
    assert not any(step(roomy, n) for n in (1, 2, 3)) and roomy.target is None  # time for max_steps: no stop


# ----------------------------------------------------------------------------------------------------------
# The second run (docs/results.md 6c): the annealed warm start, skipped non-finite steps, the claim readings
# ----------------------------------------------------------------------------------------------------------


def test_sft_anneal_ends_at_lr_zero_by_steps_seconds_or_target(study):
    sched = study.SFTAnneal(1e-3, steps=100, seconds=None, anneal_steps=10)
    lrs = [sched.lr(step, 0.0) for step in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[10] == pytest.approx(1e-3)  # 10% warm-up to the peak
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False)) and lrs[99] < 1e-6  # cosine down to ~0
    assert sched.lr(100, 0.0) is None  # the end
    timed = study.SFTAnneal(1e-3, steps=10_000, seconds=60.0, anneal_steps=10)
    assert timed.lr(5, 30.0) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * (0.5 - 0.1) / 0.9)))
    assert timed.lr(6, 60.0) is None  # the seconds ran out first: it ended at ~0 all the same
    hit = study.SFTAnneal(1e-3, steps=1000, seconds=None, anneal_steps=4)
    at = hit.lr(500, 0.0)
    hit.hit(500)
    assert [hit.lr(s, 0.0) for s in (501, 502, 503)] == pytest.approx([at * 0.75, at * 0.5, at * 0.25])
    assert hit.lr(504, 0.0) is None and hit.hit_at == 500


def test_anneal_warm_start_stops_after_the_decay(study, tmp_path):
    out = str(tmp_path)
    study.main(["warm", "--out", out, "--task", "chain", "--sft-schedule", "anneal", "--sft-steps", "50",
                "--sft-anneal-steps", "2", "--target-accuracy", "0", "--sft-eval-every", "1", *SMALL])  # fmt: skip
    with open(os.path.join(out, "warm.json")) as f:
        warm = json.load(f)
    # hit at the check of step 1, then two decay steps (lr x 1/2 at the last): steps 0, 1, 2 ran
    assert (warm["sft_schedule"], warm["target_hit_at"], warm["sft_steps"]) == ("anneal", 1, 3)
    assert 0 < warm["last_lr"] < 1e-4


def test_skip_non_finite_leaves_the_weights_alone(study):
    from types import SimpleNamespace

    import torch

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    cb = study.SkipNonFinite()
    model.weight.grad = torch.full_like(model.weight, float("nan"))
    model.bias.grad = torch.ones_like(model.bias)
    cb.on_pre_optimizer_step(None, SimpleNamespace(global_step=6), None, model=model)
    opt.step()
    assert cb.skipped == [7] and all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    cb.on_pre_optimizer_step(None, SimpleNamespace(global_step=7), None, model=model)
    opt.step()
    assert cb.skipped == [7] and not torch.equal(model.bias, before[1])  # a finite step goes through


def test_claims_gate_and_readings(study):
    def run(regime, seed, fp4, bf16, warm=0.3):
        return {"regime": regime, "seed": seed, "test_accuracy_fp4": fp4, "test_accuracy_bf16": bf16,
                "warm_test_accuracy": warm}  # fmt: skip

    d = (0.0, 0.01, -0.01)
    results = {
        "bf16": [run("bf16", s, 0.40 + e, 0.50 + e) for s, e in enumerate(d)],  # learns: 0.3 -> 0.5
        "fp4_naive": [run("fp4_naive", s, 0.35 + e, 0.4) for s, e in enumerate(d)],  # below BF16
        "fp4_qat": [run("fp4_qat", s, 0.495 + e, 0.5) for s, e in enumerate(d)],
        "trace_replay": [run("trace_replay", s, 0.50 + e, 0.5) for s, e in enumerate(d)],
    }
    c = study.claims(results)
    assert c["gate_open"] and [row["reading"] for row in c["claims"]] == [
        "reproduced", "reproduced", "not shown", "reproduced",
    ]  # fmt: skip
    results["fp4_naive"] = [run("fp4_naive", s, 0.60 + e, 0.6) for s, e in enumerate(d)]
    assert study.claims(results)["claims"][0]["reading"] == "contradicted"
    collapsed = {k: [{**r, "test_accuracy_bf16": 0.01} if k == "bf16" else r for r in v] for k, v in results.items()}
    c = study.claims(collapsed)
    assert not c["gate_open"] and not c["bf16_learns"]
    assert {row["reading"] for row in c["claims"]} == {"no claim (gate closed)"}
    outside = {k: [{**r, "warm_test_accuracy": 0.6} for r in v] for k, v in results.items()}
    assert not study.claims(outside)["warm_in_window"]


def test_degradation_ignores_partial_windows(study):
    steps = list(range(1, 201))
    lucky_start = [0.9] * 3 + [0.3] * 197  # the first steps' short means must not set the maximum
    assert study.degradation_step(steps, lucky_start) is None
