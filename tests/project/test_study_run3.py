# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The third study run's additions to examples/study/study.py (docs/results.md 6e): the FP32 master copy for BF16
weights, the warm-up stop rule that checks the accuracy after the decay, and GRPO's KL anchor and router loss knobs."""

import json
import os

import pytest
import torch


pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = ["--size", "tiny", "--prompts-per-step", "2", "--num-generations", "2", "--max-completion-length", "12",
         "--eval-problems", "4"]  # fmt: skip


def test_fp32_masters_accumulate_what_bf16_weights_round_away(study):
    torch.manual_seed(0)
    sign = torch.randn(64, 64).sign()
    init = sign * (0.25 + 0.2 * torch.rand(64, 64))  # |w| in [0.25, 0.45): half a BF16 ulp is 2^-10, ~1e-3
    grads = [sign * (1 + torch.rand(64, 64)) for _ in range(20)]  # one direction: Adam steps ~lr each time

    def run(opt_cls, lr):
        p = torch.nn.Parameter(init.to(torch.bfloat16))
        opt = opt_cls([p], lr=lr, weight_decay=0.0)
        for g in grads:
            p.grad = g.to(torch.bfloat16)
            opt.step()
        return p, opt

    plain, _ = run(torch.optim.AdamW, 2e-4)
    assert torch.equal(plain.detach(), init.to(torch.bfloat16))  # every 2e-4 update rounded away: nothing moved
    master, opt = run(study.FP32MasterAdamW, 2e-4)
    assert (master.detach() != init.to(torch.bfloat16)).all()  # 20 steps of 2e-4 add up to more than half a ulp
    # The master is what FP32 AdamW on FP32 weights computes from the same (BF16) gradients; the weight is it rounded.
    ref = torch.nn.Parameter(init.to(torch.bfloat16).float())
    ref_opt = torch.optim.AdamW([ref], lr=2e-4, weight_decay=0.0)
    for g in grads:
        ref.grad = g.to(torch.bfloat16).float()
        ref_opt.step()
    assert torch.equal(opt.masters[0][0], ref.detach())
    assert torch.equal(master.detach(), ref.detach().to(torch.bfloat16))


def test_fp32_masters_follow_the_scheduler_and_skip_missing_grads(study):
    a, b = (
        torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16)),
        torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16)),
    )
    opt = study.FP32MasterAdamW([a, b], lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step == 0 else 1.0)  # lr 0 for the first step
    a.grad, b.grad = torch.ones_like(a), None  # b: a skipped parameter (SkipNonFinite sets .grad to None)
    opt.step()
    sched.step()
    assert torch.equal(a.detach(), torch.ones(4, dtype=torch.bfloat16))  # lr 0 came from the scheduler
    a.grad = torch.ones_like(a)
    opt.step()
    assert torch.allclose(a.detach().float(), torch.full((4,), 0.5), atol=1e-2)  # lr 0.5, Adam's first-step sign
    assert torch.equal(b.detach(), torch.ones(4, dtype=torch.bfloat16)) and not opt.inner.state.get(opt.masters[0][1])


def test_annealed_branch_leaves_the_trunk_alone_and_decays_to_zero(study):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    moments = {k: v.clone() for k, v in opt.state[model.weight].items()}
    lrs = []

    def train_step(net, optimizer, lr):
        lrs.append(lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        net(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    branch = study.annealed_branch(model, opt, 1e-2, 4, train_step)
    assert lrs == pytest.approx([1e-2, 7.5e-3, 5e-3, 2.5e-3])  # linear to 0 over 4 steps
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(torch.equal(opt.state[model.weight][k], v) for k, v in moments.items())  # moments not shared
    assert not torch.equal(branch.weight, model.weight)
    assert opt.param_groups[0]["lr"] == 1e-2


def test_branch_warm_start_is_the_checked_annealed_copy(study, tmp_path):
    hit = str(tmp_path / "hit")
    study.main(["warm", "--out", hit, "--task", "chain", "--sft-schedule", "branch", "--sft-steps", "50",
                "--sft-anneal-steps", "2", "--target-accuracy", "0", "--branch-from", "0", "--sft-eval-every", "1",
                *SMALL])  # fmt: skip
    with open(os.path.join(hit, "warm.json")) as f:
        warm = json.load(f)
    # step 0 trained, the check at step 1 annealed a copy over 2 steps and took it: 1 + 2 steps
    assert (warm["target_hit_at"], warm["sft_steps"], [b["step"] for b in warm["branches"]]) == (1, 3, [1])
    assert warm["test_accuracy_bf16"] == warm["branches"][0]["test_accuracy"]  # the warm start is what was checked
    assert warm["last_lr"] == pytest.approx(warm["branches"][0]["lr"] / 2)
    miss = str(tmp_path / "miss")
    study.main(["warm", "--out", miss, "--task", "chain", "--sft-schedule", "branch", "--sft-steps", "4",
                "--sft-anneal-steps", "1", "--target-accuracy", "2", "--branch-from", "0", "--sft-eval-every", "2",
                *SMALL])  # fmt: skip
    with open(os.path.join(miss, "warm.json")) as f:
        warm = json.load(f)
    # an unreachable target: a copy at each check is tried and dropped; the trunk runs to its own end (lr -> 0)
    assert (warm["target_hit_at"], warm["sft_steps"], [b["step"] for b in warm["branches"]]) == (None, 4, [2])


def test_grpo_with_kl_anchor_fp32_masters_and_no_router_loss(study, tmp_path):
    out = str(tmp_path)
    chain = ["--task", "chain", *SMALL]
    study.main(["warm", "--out", out, "--sft-steps", "2", *chain])
    knobs = ["--beta", "0.04", "--master-weights", "fp32", "--router-aux-loss-coef", "0", "--learning-rate", "1e-3"]
    for regime in ("all_sites_replay",):  # FP4 experts and KV: the regime whose reference could differ most
        study.main(["grpo", "--out", out, "--regime", regime, "--steps", "2", *knobs, *chain])
        with open(os.path.join(out, f"{regime}_seed0", "result.json")) as f:
            r = json.load(f)
        assert (r["beta"], r["master_weights"], r["router_aux_loss_coef"], r["steps_done"]) == (0.04, "fp32", 0.0, 2)
        assert r["reference"] == {"attn": "sdpa", "quantized": False}  # one plain BF16 reference in every regime
        steps = [h for h in r["history"] if "reward" in h]
        # TRL's KL to the reference (the unquantized warm start) is logged once beta > 0; no router loss is.
        assert all("kl" in h and h["kl"] >= 0 for h in steps) and not any("aux_loss" in h for h in steps)


def test_pilot_task_and_dtype(study):
    from trace_hf.data import exact_answer_reward

    train, test = study.data("add")
    assert len(train) == len(test) == 100 and train["prompt"] == test["prompt"]  # the pilot trains on its test set
    assert study.reward_of("add") is exact_answer_reward
    assert exact_answer_reward([" 2+3=<<2+3=5>>\n#### 5", " 5"], ["2+3=<<2+3=5>>\n#### 5"] * 2) == [1.0, 0.0]
    assert study.device_and_dtype("bfloat16")[1] is torch.bfloat16  # BF16 weights on the CPU, for the pilot
    assert study.device_and_dtype()[1] is (torch.bfloat16 if torch.cuda.is_available() else torch.float32)
