# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The paper's comparison at small scale: does FP4 with hints train like BF16, and better than naive FP4?

    python examples/study/study.py warm   --out outputs/study                       # SFT-warm the ~100M MoE
    python examples/study/study.py grpo   --out outputs/study --regime trace_replay # one regime (GRPO + eval)
    python examples/study/study.py report --out outputs/study                       # tables + plots

With headroom (issue 34; examples/study/run_study_h200.sh runs it): `--task chain --size mini` on both `warm` (with
`--target-accuracy` to stop SFT in a window) and `grpo`; `report` then adds the final accuracies with seed SEs, the
degradation step of each seed and the pre-registered comparisons (`COMPARISONS`, docs/results.md section 6). The
third run (6e) adds `--sft-schedule branch` (the warm start's accuracy checked after its decay), `--master-weights
fp32`, `--beta` with one BF16 reference for every regime, and TRL's router loss, loss type and reward scaling.

Regimes (same warm start, steps, seeds and data):

    bf16          BF16 rollout, BF16 training (plain model); its FP4 evaluation is the PTQ baseline
    fp4_naive     FP4 rollout, BF16 training (TraceFP4Config(qat=False)), no hints, no replay
    fp4_qat       FP4 rollout, QAT, no hints, no replay
    trace         FP4 rollout, QAT, hints on the experts' input of the last half of the MoE layers
    trace_replay  trace + routing replay
    trace_replay_h25 / trace_replay_h100   the layer ablation: hints on the last 25% / 100% of the MoE layers
    all_sites     hints at every FP4 site (experts input, experts hidden, K/V) of the last half of the MoE layers
    all_sites_replay / all_sites_h100      all_sites + routing replay, on the last half / all of the MoE layers

Every run writes `<out>/<regime>_seed<seed>/result.json`: TRL's log history (with `eval/test_accuracy` every
`--eval-every` steps), final test accuracy with FP4 inference (the packed rollout path) and with BF16 inference (the
same master weights, unquantized), the hint bytes per token of the regime (study model and Qwen3.5-35B-A3B's shape,
from the configs alone), the steps done (`--max-train-seconds` may stop a run early) and wall time. `report` averages
seeds and writes table.md, summary.json, study.png, kl_vs_bytes.png and, with evaluations, curves.png.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from typing import NamedTuple

import torch
from transformers import TrainerCallback


ALL_SITES = ("experts_input", "experts_hidden", "kv")


class Regime(NamedTuple):
    quantized: bool
    qat: bool
    hints: bool
    routing_replay: bool
    fraction: float  # of the MoE layers (the last ones) that record hints
    sites: tuple[str, ...] = ("experts_input",)


REGIMES = {
    "bf16": Regime(False, False, False, False, 0.0),
    "fp4_naive": Regime(True, False, False, False, 0.5),
    "fp4_qat": Regime(True, True, False, False, 0.5),
    "trace": Regime(True, True, True, False, 0.5),
    "trace_replay": Regime(True, True, True, True, 0.5),
    "trace_replay_h25": Regime(True, True, True, True, 0.25),
    "trace_replay_h100": Regime(True, True, True, True, 1.0),
    "all_sites": Regime(True, True, True, False, 0.5, ALL_SITES),
    "all_sites_replay": Regime(True, True, True, True, 0.5, ALL_SITES),
    "all_sites_h100": Regime(True, True, True, True, 1.0, ALL_SITES),
}
CARRY_DIGITS = (4, 4)  # the carry task's operand digits (docs/results.md 8)
DATA_SEED = 0  # one train/test split for every run: the warm-up trained on it, so GRPO seeds must not reshuffle it


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["warm", "grpo", "report"])
    p.add_argument("--out", default="outputs/study")
    p.add_argument("--regime", choices=list(REGIMES), default="trace_replay")
    p.add_argument(
        "--size", choices=list(SIZES), default="small", help="; ".join(f"{k}: {v}" for k, v in SIZES.items())
    )
    p.add_argument(
        "--task", choices=list(TASKS), default="word", help="; ".join(f"{k}: {v}" for k, v in TASKS.items())
    )
    p.add_argument("--sft-steps", type=int, default=600)
    p.add_argument("--sft-lr", type=float, default=5e-4)
    p.add_argument("--sft-batch", type=int, default=64, help="SFT sequences per step")
    p.add_argument("--target-accuracy", type=float, help="stop SFT at the first check with greedy accuracy >= this")
    p.add_argument("--sft-eval-every", type=int, default=100, help="SFT steps between --target-accuracy checks")
    p.add_argument("--max-sft-seconds", type=float, help="stop SFT after this many seconds of it")
    p.add_argument(
        "--sft-schedule",
        choices=["onecycle", "anneal", "branch"],
        default="onecycle",
        help="onecycle: torch's one-cycle over --sft-steps (a --target-accuracy stop can land at its peak lr); "
        "anneal: 10%% warm-up, then cosine to 0 over whichever ends first of --sft-steps and --max-sft-seconds "
        "(seconds of training: the accuracy checks not counted), "
        "and a --target-accuracy hit starts a linear decay to 0 over --sft-anneal-steps: the warm start is always "
        "a snapshot at lr 0; "
        "branch: anneal's schedule, and at every check (once the quick check reaches --branch-from) a copy of the "
        "model and optimizer decays to lr 0 over --sft-anneal-steps and is evaluated on all --eval-problems; the "
        "first copy that reaches --target-accuracy is the warm start (the stop rule checks the accuracy after the "
        "decay, which in the second run added 14 points after its 30%% check)",
    )
    p.add_argument(
        "--sft-anneal-steps",
        type=int,
        default=60,
        help="anneal: steps of the decay after the target; branch: of each annealed copy's decay",
    )
    p.add_argument("--branch-from", type=float, default=0.05, help="branch: anneal a copy at the checks whose quick "
                   "(unannealed) accuracy is at least this; below it the copy could not reach the target")  # fmt: skip
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="the weights' dtype for GRPO and evaluation (auto: bfloat16 on CUDA, float32 on CPU; "
                   "bfloat16 on CPU for a pilot of BF16 weights)")  # fmt: skip
    p.add_argument("--steps", type=int, default=30, help="GRPO steps per regime")
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=96, help="worked answers need ~60-90")
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--warmup-steps", type=int, default=0, help="GRPO's linear learning-rate warm-up (then constant)")
    p.add_argument("--temperature", type=float, default=1.0, help="GRPO's sampling temperature")
    p.add_argument("--beta", type=float, default=0.0, help="GRPO's KL coefficient to the reference policy (TRL loads "
                   "it from the warm start, unquantized BF16, for every regime)")  # fmt: skip
    p.add_argument(
        "--master-weights",
        choices=["bf16", "fp32"],
        default="bf16",
        help="bf16: AdamW updates the BF16 weights in place (runs 1 and 2); fp32: an FP32 master copy takes the "
        "updates (`FP32MasterAdamW`), the model stays BF16",
    )
    p.add_argument("--loss-type", default="dapo", help="TRL's loss_type (dapo, grpo, dr_grpo, bnpo, ...)")
    p.add_argument("--scale-rewards", default="group", choices=["group", "batch", "none"],
                   help="TRL's scale_rewards: divide the advantages by the group's reward std, the batch's, or not")  # fmt: skip
    p.add_argument("--router-aux-loss-coef", type=float, help="TRL's router_aux_loss_coef (default: the model's, "
                   "0.001; the warm-up's SFT trains without it)")  # fmt: skip
    p.add_argument("--eval-problems", type=int, default=256, help="greedy test problems per evaluation")
    p.add_argument("--eval-every", type=int, default=0, help="test accuracy every N GRPO steps (0: none)")
    p.add_argument("--max-train-seconds", type=float, help="stop GRPO before a step would pass this wall time")
    p.add_argument("--train-deadline", type=float, help="stop GRPO before a step would pass this Unix time")
    p.add_argument("--sync-dir", help="end all runs writing here at one common step (see EqualSteps)")
    p.add_argument("--sync-runs", type=int, default=1, help="how many runs write to --sync-dir")
    p.add_argument("--sync-name", help="this run's name in --sync-dir (default <regime>_seed<seed>; unique per run)")
    p.add_argument("--seed", type=int, default=0, help="GRPO seed (prompt order, sampling); the run dir's suffix")
    return p.parse_args(argv)


SIZES = {
    "small": "~100M Qwen3 MoE, 8 MoE layers, 32 experts top-4, hidden 512",
    "mini": "~12M Qwen3 MoE, 4 MoE layers, 16 experts top-2, hidden 256 (the 500-step study)",
    "pilot": "~2M Qwen3 MoE, 4 MoE layers, 8 experts top-2, hidden 128 (the BF16 pilot of docs/results.md 8: warmed "
    "on the CPU)",
    "tiny": "the tiny test model (CPU smoke)",
}
TASKS = {
    "word": "one- and two-step word problems (trace_hf.data.arithmetic_dataset; ~91%% after the warm-up)",
    "chain": "2-4 chained operations, one worked line each (trace_hf.data.chain_dataset), strict #### reward",
    "carry": "4-digit additions worked column by column with carries (trace_hf.data.carry_dataset), strict #### "
    "reward: the BF16 pilot's task (docs/results.md 8)",
    "add": "the 100 single-digit additions, trained and tested on (trace_hf.data.addition_dataset), strict #### "
    "reward: the CPU pilot's task (docs/results.md 6e)",
}


def model_config(size: str, tokenizer):
    """The study model of `size` (see `SIZES`)."""
    from trace_hf.testing import tiny_config

    if size == "tiny":
        return tiny_config("qwen3_moe", tokenizer=tokenizer)
    if size == "pilot":
        return tiny_config(
            "qwen3_moe",
            tokenizer=tokenizer,
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            moe_intermediate_size=128,
            intermediate_size=256,
        )
    if size == "mini":
        return tiny_config(
            "qwen3_moe",
            tokenizer=tokenizer,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            num_experts=16,
            num_experts_per_tok=2,
            moe_intermediate_size=256,
            intermediate_size=1024,
            max_position_embeddings=512,
        )
    return tiny_config(
        "qwen3_moe",
        tokenizer=tokenizer,
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        intermediate_size=1024,
        max_position_embeddings=512,
    )


def data(task: str = "word", size: str = "small"):
    """(train, test) of `task`; the chain task's SFT sees 32,768 problems (fewer at --size tiny, for the tests)."""
    from trace_hf.data import addition_dataset, arithmetic_dataset, carry_dataset, chain_dataset, to_grpo_dataset

    if task == "carry":
        ds = carry_dataset(
            n_train=32768, n_test=512, seed=DATA_SEED, min_digits=CARRY_DIGITS[0], max_digits=CARRY_DIGITS[1]
        )
        return to_grpo_dataset(ds["train"]), to_grpo_dataset(ds["test"])
    if task == "add":
        ds = to_grpo_dataset(addition_dataset(seed=DATA_SEED))
        return ds, ds
    if task == "chain":
        n_train = 1024 if size == "tiny" else 32768
        ds = chain_dataset(n_train=n_train, n_test=512, seed=DATA_SEED, min_ops=2, max_ops=4)
    else:
        ds = arithmetic_dataset(n_train=4096, n_test=512, seed=DATA_SEED, max_operand=12)
    return to_grpo_dataset(ds["train"]), to_grpo_dataset(ds["test"])


def reward_of(task: str):
    """The task's TRL reward function; the greedy test accuracy is its mean over the test problems."""
    from trace_hf.data import arithmetic_reward, exact_answer_reward

    return exact_answer_reward if task in ("chain", "add", "carry") else arithmetic_reward


def device_and_dtype(name: str = "auto"):
    """The device and the run dtype (`--dtype`; auto: BF16 on CUDA, FP32 on CPU)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, getattr(torch, name)


def num_hint_layers(regime: Regime, num_moe_layers: int) -> int:
    return max(1, round(regime.fraction * num_moe_layers))


def qwen35_35b_config():
    """Qwen3.5-35B-A3B's text shape, built locally: transformers' `Qwen3_5MoeTextConfig()` defaults are that model's
    (hidden 2048, 40 MoE layers, top-8 experts of width 512, full attention at every fourth layer)."""
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig()


def hint_bytes(regime: str, config) -> int:
    """Hint bytes per token a rollout keeps for training under `regime` (0 without hints), from the config alone."""
    from trace_hf import hint_bytes_per_token
    from trace_hf.models import num_moe_layers

    r = REGIMES[regime]
    if not r.hints:
        return 0
    return hint_bytes_per_token(config, hint_layers=num_hint_layers(r, num_moe_layers(config)), sites=r.sites)


# ----------------------------------------------------------------------------------------------------------
# Warm-up
# ----------------------------------------------------------------------------------------------------------


class SFTAnneal:
    """The `--sft-schedule anneal` learning rate: linear warm-up over the first 10% of progress, then cosine to 0,
    where progress is the larger of steps / `steps` and seconds / `seconds`, so the schedule ends at lr 0 whichever
    limit comes first (a busy GPU gives fewer steps, not a snapshot at a high lr). After `hit(step)` (the target
    accuracy reached) it decays linearly from its current value to 0 over `anneal_steps` more steps. `lr` returns
    None once the schedule has ended: stop there."""

    def __init__(self, peak: float, steps: int, seconds: float | None, anneal_steps: int, warmup: float = 0.1):
        self.peak, self.steps, self.seconds, self.warmup = peak, steps, seconds, warmup
        self.anneal_steps = anneal_steps
        self.hit_at, self.hit_lr, self.last = None, None, peak

    def lr(self, step: int, elapsed: float) -> float | None:
        if self.hit_at is not None:
            left = 1 - (step - self.hit_at) / self.anneal_steps
            return None if left <= 0 else self.hit_lr * left
        progress = max(step / self.steps, elapsed / self.seconds if self.seconds else 0.0)
        if progress >= 1:
            return None
        if progress < self.warmup:
            self.last = self.peak * max(progress, 1 / self.steps) / self.warmup
        else:
            self.last = self.peak * 0.5 * (1 + math.cos(math.pi * (progress - self.warmup) / (1 - self.warmup)))
        return self.last

    def hit(self, step: int) -> None:
        self.hit_at, self.hit_lr = step, self.last


def annealed_branch(model, opt, lr: float, steps: int, train_step):
    """A copy of `model` (and of its optimizer's state) trained `steps` more steps with the lr decaying linearly
    from `lr` to 0 (`SFTAnneal.hit`'s decay): what the warm start would be if SFT ended here. The original is
    untouched, so SFT can go on from it if the copy is not yet good enough."""
    branch = copy.deepcopy(model)
    branch_opt = type(opt)(branch.parameters())
    # The hyperparameters and moments, deep-copied: load_state_dict would share same-device tensors with `opt`.
    branch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for i in range(steps):
        train_step(branch, branch_opt, lr * (1 - i / steps))
    return branch


def warm(args) -> None:
    """SFT on the worked answers until the model solves a fraction of the problems; saves `<out>/warm`.

    `--target-accuracy` stops it early, at the first check (every `--sft-eval-every` steps, greedy on
    at most 128 of the `--eval-problems` test problems, in the run dtype) that reaches it: a warm start with headroom
    for GRPO. With `--sft-schedule branch` the check that decides is the annealed copy's (`annealed_branch`, on all
    `--eval-problems`), so the warm start's accuracy is the one the stop rule checked."""
    from transformers import AutoModelForCausalLM, set_seed

    from trace_hf.testing import build_char_tokenizer

    set_seed(args.seed)
    dev, dtype = device_and_dtype(args.dtype)
    tok = build_char_tokenizer()
    model = AutoModelForCausalLM.from_config(model_config(args.size, tok), dtype=torch.float32).to(dev)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    train, test = data(args.task, args.size)
    texts = [p + " " + a + tok.eos_token for p, a in zip(train["prompt"], train["answer"], strict=True)]
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.0)
    sched = None
    if args.sft_schedule == "onecycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.sft_lr, total_steps=args.sft_steps, pct_start=0.1)
    anneal = SFTAnneal(args.sft_lr, args.sft_steps, args.max_sft_seconds, args.sft_anneal_steps)
    g = torch.Generator().manual_seed(args.seed)
    skipped = 0

    def train_step(net, optimizer, lr=None) -> float:
        """One SFT step (lr set first unless None); a non-finite loss skips it. Returns the loss."""
        nonlocal skipped
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr
        idx = torch.randint(len(texts), (args.sft_batch,), generator=g).tolist()
        enc = tok([texts[i] for i in idx], return_tensors="pt", padding=True).to(dev)
        labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
        loss = net(**enc, labels=labels).loss  # fp32 weights and compute: the warm-up must not diverge
        if not torch.isfinite(loss):
            skipped += 1
            optimizer.zero_grad(set_to_none=True)
            return loss.item()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def accuracy(net, n: int) -> float:
        tok.padding_side = "left"
        try:
            return evaluate(copy.deepcopy(net).to(dtype), tok, test, n, args.max_completion_length,
                            reward=reward_of(args.task))  # fmt: skip
        finally:
            tok.padding_side = "right"

    tok.padding_side = "right"  # SFT batches: no fully masked (pad) query rows
    t0, checks, branches, steps_done, check_s = time.time(), [], [], 0, 0.0
    model.train()
    for step in range(args.sft_steps):
        if sched is None:  # anneal / branch: lr from progress in steps and seconds; it ends at lr 0
            lr = anneal.lr(step, time.time() - t0 - check_s)  # seconds of training: the checks not counted
            if lr is None:
                break
            for group in opt.param_groups:
                group["lr"] = lr
        elif args.max_sft_seconds and time.time() - t0 > args.max_sft_seconds:
            break
        if args.target_accuracy is not None and step and step % args.sft_eval_every == 0 and anneal.hit_at is None:
            c0 = time.time()
            acc = accuracy(model, min(args.eval_problems, 128))  # a quick check; the warm start's uses them all
            checks.append({"step": step, "test_accuracy": acc, "seconds": time.time() - t0})
            print(f"SFT step {step:5d}: greedy test accuracy {acc:.3f}", flush=True)
            if args.sft_schedule == "branch" and acc >= args.branch_from:
                branch = annealed_branch(model, opt, opt.param_groups[0]["lr"], args.sft_anneal_steps, train_step)
                annealed = accuracy(branch, args.eval_problems)
                branches.append({"step": step, "lr": opt.param_groups[0]["lr"], "test_accuracy": annealed})
                print(f"SFT step {step:5d}: annealed over {args.sft_anneal_steps} steps: {annealed:.3f}", flush=True)
                if annealed >= args.target_accuracy:
                    model, steps_done = branch, step + args.sft_anneal_steps
                    anneal.hit_at = step
                    check_s += time.time() - c0
                    break
                del branch
            check_s += time.time() - c0
            if acc >= args.target_accuracy and args.sft_schedule != "branch":
                if sched is not None:
                    break
                anneal.hit(step)
        loss = train_step(model, opt)
        if sched is not None:
            sched.step()
        if step % 100 == 0 or step == args.sft_steps - 1:
            print(f"SFT step {step:5d} loss {loss:.3f} ({time.time() - t0:.0f}s)", flush=True)
        steps_done = step + 1
    tok.padding_side = "left"
    print(f"SFT: {skipped} non-finite steps skipped")
    model = model.to(dtype)
    path = os.path.join(args.out, "warm")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    acc = evaluate(model, tok, test, args.eval_problems, args.max_completion_length, reward=reward_of(args.task))
    # The warm start in FP4 (W4A4 + FP4 KV): where every FP4 regime starts; on CUDA it also compiles the FP4 engine's
    # kernels once here, for the GRPO runs that start together next.
    acc_fp4 = evaluate(fp4_copy(model), tok, test, args.eval_problems, args.max_completion_length,
                       reward=reward_of(args.task))  # fmt: skip
    adopted = args.sft_schedule == "branch" and anneal.hit_at is not None
    last_lr = branches[-1]["lr"] / args.sft_anneal_steps if adopted else opt.param_groups[0]["lr"]
    result = {"task": args.task, "size": args.size, "sft_steps": steps_done, "sft_steps_max": args.sft_steps,
              "target_accuracy": args.target_accuracy, "checks": checks, "wall_s": time.time() - t0,
              "sft_schedule": args.sft_schedule, "target_hit_at": anneal.hit_at, "last_lr": last_lr,
              "check_seconds": check_s, "branches": branches,
              "test_accuracy_bf16": acc, "test_accuracy_fp4": acc_fp4}  # fmt: skip
    with open(os.path.join(args.out, "warm.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))


# ----------------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------------


def greedy_config(tokenizer, max_new_tokens: int):
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def evaluate(
    model, tokenizer, test, n: int, max_new_tokens: int, rollout=None, batch: int = 128, reward=None
) -> float:
    """Greedy accuracy on the first `n` test problems, through the library's rollout seam (`rollout`, or a new one):
    the CUDA engine where it supports the model (many times faster than `generate` for a small model), else
    `model.generate`. The model runs its own inference path: packed FP4 experts for a TraceFP4Config model.
    `reward`: the task's reward function (default: the word problems')."""
    reward = reward or reward_of("word")
    gc = greedy_config(tokenizer, max_new_tokens)
    prompts, answers = test["prompt"][:n], test["answer"][:n]
    return sum(rollout_rewards(model, tokenizer, prompts, answers, gc, reward, rollout, batch)) / len(prompts)


def rollout_rewards(model, tokenizer, prompts, answers, gc, reward, rollout=None, batch: int = 128) -> list[float]:
    """Each prompt's reward for one completion under the generation config `gc`, rolled out `batch` prompts at a
    time in eval mode (the model's inference path) through the library's rollout seam (`rollout`, or a new one)."""
    import torch

    from trace_hf.rollout import make_rollout

    rollout = rollout or make_rollout(model, "auto", gc)
    was_training = model.training
    model.eval()
    scores = []
    try:
        for i in range(0, len(prompts), batch):
            ids = tokenizer(prompts[i : i + batch]).input_ids
            with torch.no_grad():
                out = rollout(model, ids, gc)
            texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
            scores += reward(texts, answers[i : i + batch])
    finally:
        model.train(was_training)
    return scores


class TestAccuracy(TrainerCallback):
    """Greedy test accuracy of the policy in its rollout precision before training, every `every` steps and after
    the last step, appended to the log history as `eval/test_accuracy`: the accuracy curve of a long run."""

    def __init__(self, tokenizer, test, n: int, max_new_tokens: int, every: int, reward=None):
        self.tokenizer, self.test, self.n, self.max_new_tokens, self.every = tokenizer, test, n, max_new_tokens, every
        self.reward = reward
        self.rollout = None  # kept across evaluations: the engine captures its graphs once
        self.last_step = None

    def _evaluate(self, state, model) -> None:
        from trace_hf.rollout import make_rollout

        if self.rollout is None:
            self.rollout = make_rollout(model, "auto", greedy_config(self.tokenizer, self.max_new_tokens))
        t0 = time.time()
        acc = evaluate(model, self.tokenizer, self.test, self.n, self.max_new_tokens, self.rollout, reward=self.reward)
        state.log_history.append(
            {"step": state.global_step, "eval/test_accuracy": acc, "eval/seconds": time.time() - t0}
        )
        self.last_step = state.global_step
        print(f"step {state.global_step}: test accuracy {acc:.3f} ({time.time() - t0:.1f}s)", flush=True)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._evaluate(state, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0:
            self._evaluate(state, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.last_step != state.global_step:
            self._evaluate(state, model)


class TimeBudget(TrainerCallback):
    """Stops training when the next step (as long as the last one) would end past `seconds` after the start (or past
    the Unix time `deadline`), so a run that the device's wall-clock limit would cut still ends with its final
    evaluation and result.json."""

    def __init__(self, seconds: float | None = None, deadline: float | None = None):
        self.seconds, self.deadline = seconds, deadline
        self.stopped = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self.last = time.time()
        ends = [t for t in (self.seconds and self.start + self.seconds, self.deadline) if t]
        self.end = min(ends)

    def on_step_end(self, args, state, control, **kwargs):
        now = time.time()
        step, self.last = now - self.last, now
        if now + step > self.end and state.global_step < state.max_steps:
            control.should_training_stop = self.stopped = True


class EqualSteps(TrainerCallback):
    """Ends the runs of a study at one common step when the time budget cannot hold all their steps, so that slower
    regimes are not compared after fewer steps. Every step, each of the `runs` runs writes into `sync_dir` the step
    it expects to reach by `deadline` at its pace over the last `window` steps (at most max_steps). Once all have
    written, the first run whose step reaches the lowest expectation writes its step as the common last step, and
    every run stops there (`TimeBudget` still stops a run that cannot reach it in time). An expectation not updated
    for `stale_s` seconds is left out: a crashed run's last one must not set the others' last step (it did, at 474
    of 500, in the first 500-step study)."""

    def __init__(self, sync_dir: str, name: str, runs: int, deadline: float, window: int = 50, stale_s: float = 60):
        self.sync_dir, self.name, self.runs, self.deadline, self.window = sync_dir, name, runs, deadline, window
        self.stale_s = stale_s
        self.target = None  # the common last step, once set
        os.makedirs(sync_dir, exist_ok=True)

    def _write(self, name: str, text: str, exclusive: bool = False) -> bool:
        """Writes `text` to `name` atomically (readers never see it half written); `exclusive`: only if no run has."""
        path = os.path.join(self.sync_dir, name)
        tmp = os.path.join(self.sync_dir, f".{self.name}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        if not exclusive:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)  # fails if the file exists: the first run to link it wins
            return True
        except FileExistsError:
            return False
        finally:
            os.remove(tmp)

    def on_train_begin(self, args, state, control, **kwargs):
        self.times = [time.time()]

    def on_step_end(self, args, state, control, **kwargs):
        now, step = time.time(), state.global_step
        self.times.append(now)
        stop = os.path.join(self.sync_dir, "STOP")
        if self.target is None and os.path.exists(stop):
            with open(stop) as f:
                self.target = int(f.read())
        if self.target is None:
            w = min(self.window, len(self.times) - 1)
            pace = max(1e-6, (now - self.times[-1 - w]) / w)
            self._write(f"{self.name}.expect", str(min(state.max_steps, step + int((self.deadline - now) / pace))))
            seen, expected = 0, []
            for name in os.listdir(self.sync_dir):
                if name.endswith(".expect"):
                    path = os.path.join(self.sync_dir, name)
                    seen += 1
                    if now - os.path.getmtime(path) < self.stale_s:  # older: a run that crashed or finished
                        with open(path) as f:
                            expected.append(int(f.read() or 0))
            if seen >= self.runs and expected and min(expected) <= step < state.max_steps:
                self._write("STOP", str(step), exclusive=True)  # the first run here sets it; the others read it
                with open(stop) as f:
                    self.target = int(f.read())
        if self.target is not None and step >= self.target:
            control.should_training_stop = True


class SkipNonFinite(TrainerCallback):
    """Skips the optimizer step of any step whose gradient has a NaN or inf (every `.grad` set to None: AdamW then
    leaves those weights and their moments alone) and counts them. In the first 500-step study one run's NaN
    gradient at step 207 went into the weights and killed the run; the trainer itself does not skip such steps."""

    def __init__(self):
        self.skipped: list[int] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        import torch

        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if grads and not torch.isfinite(torch.nn.utils.get_total_norm(grads)):  # one device sync per step
            for p in model.parameters():
                p.grad = None
            self.skipped.append(state.global_step + 1)
            print(f"step {state.global_step + 1}: non-finite gradient, optimizer step skipped", flush=True)


class FP32MasterAdamW(torch.optim.Optimizer):
    """AdamW that keeps an FP32 master copy of every (BF16) parameter: the step updates the masters, then writes them
    rounded into the parameters. The model stays BF16 for the rollout and the training forward; only the update is
    accumulated in FP32, so steps smaller than half a BF16 unit in the last place add up instead of rounding away
    (with BF16 weights an AdamW step at lr 1e-5 moves 15% of the mini model's weight elements at all:
    examples/study/bf16_updates.py). The hyperparameters are `torch.optim.AdamW`'s; the trainer's scheduler sets
    this optimizer's lr, which each step hands to the inner AdamW. A parameter whose `.grad` is None (a skipped
    step, `SkipNonFinite`) is left alone, its master and moments too."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.masters = [[p.detach().float().clone() for p in g["params"]] for g in self.param_groups]
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": m}
                  for g, m in zip(self.param_groups, self.masters, strict=True)]  # fmt: skip
        self.inner = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        with torch.no_grad():
            for group, inner, masters in zip(self.param_groups, self.inner.param_groups, self.masters, strict=True):
                inner.update({k: v for k, v in group.items() if k != "params"})
                for p, m in zip(group["params"], masters, strict=True):
                    m.grad = None if p.grad is None else p.grad.float()
            self.inner.step()
            for group, masters in zip(self.param_groups, self.masters, strict=True):
                for p, m in zip(group["params"], masters, strict=True):
                    if m.grad is not None:
                        p.copy_(m)  # an in-place write: bumps the version counter that FP4 weight caches watch
                        m.grad = None
        return loss


def plain_copy(model):
    """The same master weights in an unquantized model (BF16 inference)."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(model.config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg._attn_implementation = "sdpa"
    plain = AutoModelForCausalLM.from_config(cfg, dtype=model.dtype).to(model.device)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    return plain


def fp4_copy(model):
    """The same master weights with FP4 experts and KV cache (FP4 inference; PTQ for a BF16-trained policy)."""
    from trace_hf import TraceFP4Config
    from trace_hf.quant.quantizer import quantize_model

    return quantize_model(plain_copy(model), TraceFP4Config())


# ----------------------------------------------------------------------------------------------------------
# GRPO
# ----------------------------------------------------------------------------------------------------------


def run_dir(out: str, regime: str, seed: int) -> str:
    return os.path.join(out, f"{regime}_seed{seed}")


def grpo(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from trace_hf import TraceFP4Config, TraceGRPOConfig, TraceGRPOTrainer
    from trace_hf.quant.experts import fp4_experts

    regime = REGIMES[args.regime]
    set_seed(args.seed)
    dev, dtype = device_and_dtype(args.dtype)
    warm_path = os.path.join(args.out, "warm")
    if not os.path.isdir(warm_path):
        raise SystemExit(f"No warm start at {warm_path}: run `study.py warm --out {args.out}` first.")
    with open(os.path.join(args.out, "warm.json")) as f:
        warmed = json.load(f)
    if (warmed.get("task", "word"), warmed.get("size", args.size)) != (args.task, args.size):
        raise SystemExit(f"The warm start at {warm_path} is --task {warmed.get('task', 'word')} --size "
                         f"{warmed.get('size')}: pass the same --task and --size to grpo.")  # fmt: skip
    reward = reward_of(args.task)
    tok = AutoTokenizer.from_pretrained(warm_path)
    study_config = model_config(args.size, tok)
    quant = None
    if regime.quantized:
        hint_layers = num_hint_layers(regime, study_config.num_hidden_layers)  # every layer is MoE
        quant = TraceFP4Config(qat=regime.qat, hint_layers=hint_layers, hint_sites=list(regime.sites))
    model = AutoModelForCausalLM.from_pretrained(warm_path, dtype=dtype, quantization_config=quant).to(dev)
    train, test = data(args.task, args.size)
    out_dir = run_dir(args.out, args.regime, args.seed)
    config = TraceGRPOConfig(
        output_dir=out_dir,
        rollout_precision="fp4" if regime.quantized else "bf16",
        trace_hints=regime.hints,
        routing_replay=regime.routing_replay,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant_with_warmup" if args.warmup_steps else "constant",
        warmup_steps=args.warmup_steps,
        beta=args.beta,
        router_aux_loss_coef=args.router_aux_loss_coef,
        loss_type=args.loss_type,
        scale_rewards=args.scale_rewards,
        # beta > 0: TRL loads the reference from the warm start, with the policy's attention unless told; an FP4
        # policy's (`trace_fp4_kv:...`) would give FP4 regimes an FP4-KV reference. One BF16 reference for all.
        model_init_kwargs={"attn_implementation": "sdpa"} if args.beta else None,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        bf16=False,
        activation_checkpointing=False,
        use_cpu=dev.type == "cpu",
        disable_tqdm=True,
    )
    skip = SkipNonFinite()
    callbacks = [skip]
    if args.eval_every:
        callbacks.append(
            TestAccuracy(tok, test, args.eval_problems, args.max_completion_length, args.eval_every, reward)
        )
    budget = None
    if args.max_train_seconds or args.train_deadline:
        budget = TimeBudget(args.max_train_seconds, args.train_deadline)
        callbacks.append(budget)  # after the evaluation: a step's time includes it
    equal = None
    if args.sync_dir:
        if not args.train_deadline:
            raise SystemExit("--sync-dir needs --train-deadline (the Unix time every run's expectation aims at).")
        name = args.sync_name or f"{args.regime}_seed{args.seed}"
        equal = EqualSteps(args.sync_dir, name, args.sync_runs, args.train_deadline)
        callbacks.append(equal)
    trainer = TraceGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=train,
        processing_class=tok,
        callbacks=callbacks,
        optimizers=(FP32MasterAdamW(model.parameters(), lr=args.learning_rate), None)
        if args.master_weights == "fp32"
        else (None, None),
    )
    t0 = time.time()
    trainer.train()
    wall = time.time() - t0
    model = trainer.model
    fp4_model = model if regime.quantized else fp4_copy(model)
    result = {
        "regime": args.regime,
        "hint_layers": [m.moe_index for m in fp4_experts(model) if m.hinted] if regime.hints else [],
        "hint_sites": list(regime.sites) if regime.hints else [],
        "hint_bytes_per_token": hint_bytes(args.regime, study_config),
        "hint_bytes_per_token_qwen35_35b": hint_bytes(args.regime, qwen35_35b_config()),
        "seed": args.seed,
        "steps": args.steps,
        "steps_done": trainer.state.global_step,
        "stopped_by_budget": bool(budget and budget.stopped),
        "common_last_step": equal.target if equal else None,
        "nonfinite_steps_skipped": skip.skipped,
        "learning_rate": args.learning_rate,
        "warmup_steps": args.warmup_steps,
        "temperature": args.temperature,
        "beta": args.beta,
        "master_weights": args.master_weights,
        "router_aux_loss_coef": args.router_aux_loss_coef,
        "loss_type": args.loss_type,
        "scale_rewards": args.scale_rewards,
        "reference": None
        if trainer.ref_model is None
        else {
            "attn": trainer.ref_model.config._attn_implementation,
            "quantized": bool(fp4_experts(trainer.ref_model)),
        },
        "num_generations": args.num_generations,
        "prompts_per_step": args.prompts_per_step,
        "train_wall_s": wall,
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "history": trainer.state.log_history,
        "task": args.task,
        "warm_test_accuracy": warmed["test_accuracy_bf16"],
        "test_accuracy_fp4": evaluate(
            fp4_model, tok, test, args.eval_problems, args.max_completion_length, reward=reward
        ),
        "test_accuracy_bf16": evaluate(
            plain_copy(model), tok, test, args.eval_problems, args.max_completion_length, reward=reward
        ),
    }
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "history"}))


# ----------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------

GAP_MEAN, GAP_MAX = "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"
KL = "trace/kl_rollout_train"
FLIP, ROUTING, ACC = "trace/hint_flip_rate", "trace/routing_mismatch", "eval/test_accuracy"


def load_results(out: str) -> dict[str, list[dict]]:
    """Every `<out>/*/result.json`, grouped by regime (in `REGIMES` order), seeds in order."""
    runs: dict[str, list[dict]] = {}
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name, "result.json")
        if os.path.isfile(path):
            with open(path) as f:
                r = json.load(f)
            runs.setdefault(r["regime"], []).append(r)
    return {k: sorted(runs[k], key=lambda r: r["seed"]) for k in REGIMES if k in runs}


def steps_of(r: dict) -> list[dict]:
    return [h for h in r["history"] if "reward" in h]


def run_stat(r: dict, key: str) -> float | None:
    """One run's value of a per-step metric: the max over steps for a `.../max`, else the mean; None if not logged."""
    vals = [h[key] for h in steps_of(r) if h.get(key) is not None and math.isfinite(h[key])]
    if not vals:
        return None
    return max(vals) if key.endswith("/max") else sum(vals) / len(vals)


def seed_mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def curve(runs: list[dict], key: str, evals: bool = False) -> tuple[list[int], list[float]]:
    """(steps, mean over the seeds that logged `key` at that step)."""
    by_step: dict[int, list[float]] = {}
    for r in runs:
        for h in r["history"] if evals else steps_of(r):
            if h.get(key) is not None and math.isfinite(h[key]):
                by_step.setdefault(h["step"], []).append(h[key])
    x = sorted(by_step)
    return x, [sum(by_step[s]) / len(by_step[s]) for s in x]


def smooth(y: list[float], window: int) -> list[float]:
    return [sum(y[max(0, i - window + 1) : i + 1]) / len(y[max(0, i - window + 1) : i + 1]) for i in range(len(y))]


# The pre-registered outcome rules (docs/results.md, section 6), fixed before the 500-step run.
DEGRADE_WINDOW, DEGRADE_DROP, DEGRADE_HOLD = 25, 0.10, 50
MIN_EFFECT = 0.02  # the smallest accuracy difference called a separation (1 in 50 test problems)
COMPARISONS = (  # (claim, regime a, its accuracy, regime b, its accuracy): a - b, final greedy test accuracy
    ("GRPO learns: BF16 policy (BF16 inference) vs the warm start", "bf16", "test_accuracy_bf16", "warm", "start"),
    ("naive FP4 vs BF16 (each in its rollout precision)", "fp4_naive", "test_accuracy_fp4", "bf16",
     "test_accuracy_bf16"),
    ("QAT without hints vs BF16", "fp4_qat", "test_accuracy_fp4", "bf16", "test_accuracy_bf16"),
    ("TRACE vs BF16", "trace_replay", "test_accuracy_fp4", "bf16", "test_accuracy_bf16"),
    ("TRACE vs QAT without hints", "trace_replay", "test_accuracy_fp4", "fp4_qat", "test_accuracy_fp4"),
    ("TRACE vs naive FP4", "trace_replay", "test_accuracy_fp4", "fp4_naive", "test_accuracy_fp4"),
    ("TRACE (FP4) vs the BF16 policy quantized after training (PTQ)", "trace_replay", "test_accuracy_fp4", "bf16",
     "test_accuracy_fp4"),
    ("every site vs TRACE", "all_sites_replay", "test_accuracy_fp4", "trace_replay", "test_accuracy_fp4"),
    ("PTQ: the BF16 policy in FP4 vs in BF16", "bf16", "test_accuracy_fp4", "bf16", "test_accuracy_bf16"),
)  # fmt: skip


def degradation_step(steps: list[int], rewards: list[float]) -> int | None:
    """The pre-registered degradation rule: the first step from which the trailing `DEGRADE_WINDOW`-step mean reward
    stays more than `DEGRADE_DROP` below its running maximum for `DEGRADE_HOLD` consecutive steps; None if never.
    Means over fewer than `DEGRADE_WINDOW` steps (the first steps) are left out (section 6c)."""
    best, start, below = -math.inf, None, 0
    for i, (step, value) in enumerate(zip(steps, smooth(rewards, DEGRADE_WINDOW), strict=True)):
        if i + 1 < DEGRADE_WINDOW:  # only full windows: a first step's lucky mean must not set the maximum (6b)
            continue
        best = max(best, value)
        if value < best - DEGRADE_DROP:
            start, below = (step if below == 0 else start), below + 1
            if below >= DEGRADE_HOLD:
                return start
        else:
            below = 0
    return None


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (sample std / sqrt(n); 0 for one value) over seeds."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n)


def outcomes(results: dict[str, list[dict]]) -> list[dict]:
    """The pre-registered comparisons that the results allow: difference of seed means, its standard error
    sqrt(se_a^2 + se_b^2), and the verdict: "separate" when |diff| > 2 se and |diff| >= `MIN_EFFECT`, else "no
    separation" (with the smallest difference this spread could have shown, 2 se)."""
    rows = []
    for claim, a, key_a, b, key_b in COMPARISONS:
        if a not in results or (b != "warm" and b not in results):
            continue
        va = [r[key_a] for r in results[a]]
        vb = [r["warm_test_accuracy"] for r in results[a][:1]] if b == "warm" else [r[key_b] for r in results[b]]
        (ma, sa), (mb, sb) = mean_se(va), mean_se(vb)
        diff, se = ma - mb, math.sqrt(sa**2 + sb**2)
        verdict = "separate" if abs(diff) > 2 * se and abs(diff) >= MIN_EFFECT else "no separation"
        rows.append({"claim": claim, "a": f"{a} {key_a}", "b": f"{b} {key_b}", "mean_a": ma, "mean_b": mb,
                     "diff": diff, "se": se, "verdict": verdict})  # fmt: skip
    return rows


WARM_WINDOW = (0.20, 0.50)  # the warm start's greedy test accuracy that leaves GRPO headroom (section 6a)
CLAIMS = (  # (the paper's claim, index into COMPARISONS, the verdict and sign that reproduce it)
    ("naive FP4 ends below BF16", 1, "separate", -1),
    ("TRACE matches BF16", 3, "no separation", 0),
    ("TRACE beats QAT without hints", 4, "separate", +1),
    ("TRACE-trained FP4 policy beats PTQ of the BF16 policy", 6, "separate", +1),
)


def claims(results: dict[str, list[dict]]) -> dict:
    """The pre-registered reading of `outcomes` (section 6a): the gate (the warm start inside `WARM_WINDOW` and BF16
    GRPO learning: comparison 1 separates upwards), then each of the paper's `CLAIMS` as "reproduced",
    "contradicted" (separate the other way; for "TRACE matches BF16": separate at all) or "not shown". With the gate
    closed every claim reads "no claim (gate closed)"."""
    rows = {o["claim"]: o for o in outcomes(results)}
    warm = next((r["warm_test_accuracy"] for runs in results.values() for r in runs), None)
    learn = rows.get(COMPARISONS[0][0])
    in_window = warm is not None and WARM_WINDOW[0] <= warm <= WARM_WINDOW[1]
    learns = learn is not None and learn["verdict"] == "separate" and learn["diff"] > 0
    gate = in_window and learns
    out = {"warm_test_accuracy": warm, "warm_in_window": in_window, "bf16_learns": learns, "gate_open": gate,
           "claims": []}  # fmt: skip
    for text, i, verdict, sign in CLAIMS:
        o = rows.get(COMPARISONS[i][0])
        if o is None:
            reading = "not run"
        elif not gate:
            reading = "no claim (gate closed)"
        elif sign == 0:
            reading = "reproduced" if o["verdict"] == "no separation" else "contradicted"
        elif o["verdict"] == "separate":
            reading = "reproduced" if o["diff"] * sign > 0 else "contradicted"
        else:
            reading = "not shown"
        out["claims"].append({"claim": text, "comparison": COMPARISONS[i][0], "reading": reading,
                              "diff": o and o["diff"], "se": o and o["se"]})  # fmt: skip
    return out


def claims_table(results: dict[str, list[dict]]) -> str:
    c = claims(results)
    warm = "n/a" if c["warm_test_accuracy"] is None else f"{c['warm_test_accuracy']:.3f}"
    lines = [
        f"Gate: warm start {warm} (window {WARM_WINDOW[0]}-{WARM_WINDOW[1]}: {'in' if c['warm_in_window'] else 'OUT'}); "
        f"BF16 GRPO learns (comparison 1 separates upwards): {'yes' if c['bf16_learns'] else 'NO'}; "
        f"gate {'open' if c['gate_open'] else 'closed: no claim about the regimes'}.",
        "",
        "| the paper's claim | comparison | a - b | 2 SE | reading |",
        "|---|---|---|---|---|",
    ]
    for row in c["claims"]:
        nums = "n/a | n/a" if row["diff"] is None else f"{row['diff']:+.3f} | {2 * row['se']:.3f}"
        lines.append(f"| {row['claim']} | {row['comparison']} | {nums} | {row['reading']} |")
    return "\n".join(lines) + "\n"


def accuracy_by_step(results: dict[str, list[dict]]) -> str:
    """Greedy test accuracy (rollout precision) at every evaluation step that all of a regime's seeds logged:
    mean +- SE over seeds."""
    per_regime = {}
    for regime, runs in results.items():
        per_seed = [{h["step"]: h[ACC] for h in r["history"] if ACC in h} for r in runs]
        steps = sorted(set.intersection(*(set(c) for c in per_seed))) if per_seed else []
        per_regime[regime] = {step: mean_se([c[step] for c in per_seed]) for step in steps}
    steps = sorted({step for v in per_regime.values() for step in v})
    if not steps:
        return ""
    lines = ["| regime | " + " | ".join(str(s) for s in steps) + " |", "|---" * (len(steps) + 1) + "|"]
    for regime, v in per_regime.items():
        cells = [f"{v[s][0]:.3f} +- {v[s][1]:.3f}" if s in v else "" for s in steps]
        lines.append(f"| {regime} | " + " | ".join(cells) + " |")
    return (
        "Greedy test accuracy by GRPO step (rollout precision; mean +- SE over seeds):\n\n" + "\n".join(lines) + "\n"
    )


def accuracy_table(results: dict[str, list[dict]], summary: dict[str, dict]) -> str:
    """The outcome table: final greedy test accuracy (FP4 and BF16 inference) per seed, mean +- SE, the reward's
    start and end, the degradation step of each seed, then the pre-registered comparisons."""

    def fmt(v):
        return "n/a" if v is None else f"{v:.3f}"

    def acc(runs, key):
        m, se = mean_se([r[key] for r in runs])
        return f"{m:.3f} +- {se:.3f} ({', '.join(f'{r[key]:.3f}' for r in runs)})"

    head = ["regime", "seeds", "steps", "warm acc", "reward, first 50 -> last 50 steps", "test acc by step",
            "final acc, FP4 inference", "final acc, BF16 inference", "degraded at step (per seed)",
            "zero-std groups, first 50 -> last 50", "entropy, first 50 -> last 50", "non-finite steps skipped"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for regime, runs in results.items():
        s = summary[regime]
        steps = sorted(set(s["steps_done"]))
        lines.append("| " + " | ".join([
            regime, str(len(runs)), "-".join(str(n) for n in (steps[0], steps[-1])) if len(steps) > 1 else str(steps[0]),
            f"{runs[0].get('warm_test_accuracy', float('nan')):.3f}",
            f"{s['reward_first50']:.3f} -> {s['reward_last50']:.3f}",
            f"{s['eval_first']:.3f} -> {s['eval_last']:.3f}" if s["eval_first"] is not None else "n/a",
            acc(runs, "test_accuracy_fp4"), acc(runs, "test_accuracy_bf16"),
            ", ".join("-" if d is None else str(d) for d in s["degraded_at"]),
            f"{fmt(s['frac_reward_zero_std_first50'])} -> {fmt(s['frac_reward_zero_std_last50'])}",
            f"{fmt(s['entropy_first50'])} -> {fmt(s['entropy_last50'])}",
            str(sum(len(k) for k in s["nonfinite_steps_skipped"])),
        ]) + " |")  # fmt: skip
    lines += ["", "| comparison (a - b) | a | b | mean a | mean b | a - b | SE | verdict |", "|---" * 8 + "|"]
    for o in outcomes(results):
        lines.append(f"| {o['claim']} | {o['a']} | {o['b']} | {o['mean_a']:.3f} | {o['mean_b']:.3f} | "
                     f"{o['diff']:+.3f} | {o['se']:.3f} | {o['verdict']} |")  # fmt: skip
    notes = (
        f"\nSE: sample std over seeds / sqrt(seeds); a comparison's SE is sqrt(se_a^2 + se_b^2); separate: |a - b| > "
        f"2 SE and >= {MIN_EFFECT}. Degraded: the trailing {DEGRADE_WINDOW}-step mean reward stays more than "
        f"{DEGRADE_DROP} below its running max for {DEGRADE_HOLD} steps ('-': never). FP4 inference: W4A4 experts "
        "+ FP4 KV cache (the packed rollout path); for bf16 that is post-training quantization (PTQ).\n"
    )
    return "\n".join(lines) + "\n" + notes + "\n" + claims_table(results) + "\n" + accuracy_by_step(results)


def summarize(results: dict[str, list[dict]]) -> dict[str, dict]:
    """Per regime, every quantity averaged over seeds (a run's per-step metrics first reduced by `run_stat`)."""
    from trace_hf.quant.config import HINT_SITES

    summary = {}
    for regime, runs in results.items():
        s = {
            "seeds": [r["seed"] for r in runs],
            "steps_done": [r.get("steps_done", r["steps"]) for r in runs],
            "hint_bytes_per_token": runs[0]["hint_bytes_per_token"],
            "hint_bytes_per_token_qwen35_35b": runs[0]["hint_bytes_per_token_qwen35_35b"],
        }
        for name, key in [("gap_mean", GAP_MEAN), ("gap_max", GAP_MAX), ("kl", KL), ("flip_rate", FLIP),
                          ("routing_mismatch", ROUTING)]:  # fmt: skip
            s[name] = seed_mean(run_stat(r, key) for r in runs)
        s["kl_per_seed"] = [run_stat(r, KL) for r in runs]
        s["flip_rate_by_site"] = {
            site: v for site in HINT_SITES if (v := seed_mean(run_stat(r, f"{FLIP}/{site}") for r in runs)) is not None
        }
        rewards = [[h["reward"] for h in steps_of(r)] for r in runs]
        k = [max(1, min(len(rw), max(5, len(rw) // 10))) for rw in rewards]
        s["reward_first"] = seed_mean(sum(rw[:n]) / n for rw, n in zip(rewards, k, strict=True) if rw)
        s["reward_last"] = seed_mean(sum(rw[-n:]) / n for rw, n in zip(rewards, k, strict=True) if rw)
        s["reward_first50"] = seed_mean(sum(rw[:50]) / len(rw[:50]) for rw in rewards if rw)
        s["reward_last50"] = seed_mean(sum(rw[-50:]) / len(rw[-50:]) for rw in rewards if rw)
        s["degraded_at"] = [
            degradation_step([h["step"] for h in steps_of(r)], rw) for r, rw in zip(runs, rewards, strict=True)
        ]
        s["test_accuracy_fp4_per_seed"] = [r["test_accuracy_fp4"] for r in runs]
        s["test_accuracy_bf16_per_seed"] = [r["test_accuracy_bf16"] for r in runs]
        evals = [[h[ACC] for h in r["history"] if ACC in h] for r in runs]
        s["eval_first"] = seed_mean(e[0] for e in evals if e)
        s["eval_last"] = seed_mean(e[-1] for e in evals if e)
        s["test_accuracy_fp4"] = seed_mean(r["test_accuracy_fp4"] for r in runs)
        s["test_accuracy_bf16"] = seed_mean(r["test_accuracy_bf16"] for r in runs)
        s["train_wall_s"] = seed_mean(r["train_wall_s"] for r in runs)
        for name, key in [("frac_reward_zero_std", "frac_reward_zero_std"), ("entropy", "entropy")]:
            s[f"{name}_first50"] = seed_mean(seed_mean(h.get(key) for h in steps_of(r)[:50]) for r in runs)
            s[f"{name}_last50"] = seed_mean(seed_mean(h.get(key) for h in steps_of(r)[-50:]) for r in runs)
        s["nonfinite_steps_skipped"] = [r.get("nonfinite_steps_skipped", []) for r in runs]
        summary[regime] = s
    return summary


def table(summary: dict[str, dict]) -> str:
    def f(v, fmt=".3g"):
        return "n/a" if v is None else format(v, fmt)

    sites = [site for site in ALL_SITES if any(site in s["flip_rate_by_site"] for s in summary.values())]
    head = ["regime", "seeds", "steps", "mean \\|dlogp\\|", "max \\|dlogp\\|", "KL rollout/train", "flip rate",
            *[f"flip {site}" for site in sites], "routing mismatch", "hint B/token (study)",
            "hint B/token (Qwen3.5-35B-A3B)", "reward first -> last", "test acc by step (first -> last)",
            "test acc FP4", "test acc BF16", "train wall s"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for regime, s in summary.items():
        steps = sorted(set(s["steps_done"]))
        cells = [
            regime,
            str(len(s["seeds"])),
            "-".join(str(n) for n in (steps[0], steps[-1])) if len(steps) > 1 else str(steps[0]),
            f(s["gap_mean"]),
            f(s["gap_max"]),
            f(s["kl"]),
            f(s["flip_rate"]),
            *[f(s["flip_rate_by_site"].get(site)) for site in sites],
            f(s["routing_mismatch"]),
            f"{s['hint_bytes_per_token']:,}",
            f"{s['hint_bytes_per_token_qwen35_35b']:,}",
            f"{f(s['reward_first'], '.3f')} -> {f(s['reward_last'], '.3f')}",
            f"{f(s['eval_first'], '.3f')} -> {f(s['eval_last'], '.3f')}",
            f(s["test_accuracy_fp4"], ".3f"),
            f(s["test_accuracy_bf16"], ".3f"),
            f(s["train_wall_s"], ".0f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    notes = (
        "\nPer run: |dlogp| and KL per completion token, mean over steps (max |dlogp|: max over steps); then the mean "
        "over seeds. Rewards: mean of the first and last max(5, steps/10) steps. Hint bytes per token from the "
        "configs alone (`trace_hf.hint_bytes_per_token`); 0 where the regime applies no hints.\n"
    )
    return "\n".join(lines) + "\n" + notes


def report(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = load_results(args.out)
    if not results:
        raise SystemExit(f"No results under {args.out}: run `study.py grpo --regime ...` first.")
    summary = summarize(results)
    text = table(summary)
    if all("warm_test_accuracy" in r for runs in results.values() for r in runs):
        text += "\n" + accuracy_table(results, summary)
    print(text)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({**summary, "outcomes": outcomes(results), "claims": claims(results)}, f, indent=1)
    written = ["table.md", "summary.json", "study.png", "kl_vs_bytes.png"]

    fig, axes = plt.subplots(1, 5, figsize=(26, 4))
    for regime, runs in results.items():
        for ax, key in zip(axes, ["reward", GAP_MEAN, KL, "entropy", "frac_reward_zero_std"], strict=True):
            ax.plot(*curve(runs, key), label=regime)
    titles = ["reward", "mean |logp_train - logp_rollout|", "KL(rollout || train)", "entropy per token",
              "prompt groups with zero reward std"]  # fmt: skip
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title + " (mean over seeds)")
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "study.png"), dpi=110)
    plt.close(fig)

    plot_kl_vs_bytes(plt, summary, os.path.join(args.out, "kl_vs_bytes.png"))

    if any(ACC in h for runs in results.values() for r in runs for h in r["history"]):
        plot_curves(plt, results, os.path.join(args.out, "curves.png"))
        written.append("curves.png")
    print("wrote " + ", ".join(os.path.join(args.out, w) for w in written))


def plot_kl_vs_bytes(plt, summary: dict[str, dict], path: str) -> None:
    """KL against hint bytes per token (study model; Qwen3.5-35B-A3B's shape), log-log, one labelled point per
    regime; regimes without hints sit at a marked stand-in position left of the smallest hinted one."""
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, key, title in [
        (axes[0], "hint_bytes_per_token", "study model"),
        (axes[1], "hint_bytes_per_token_qwen35_35b", "at Qwen3.5-35B-A3B's shape (config only)"),
    ]:
        points = {r: s for r, s in summary.items() if s["kl"] is not None}
        hinted = [s[key] for s in points.values() if s[key] > 0]
        zero_x = min(hinted) / 4 if hinted else 1.0
        positive = [s["kl"] for s in points.values() if s["kl"] > 0]
        zero_y = min(positive) / 10 if positive else 1e-12  # a KL of exactly 0 (identical kernels), marked as such
        for regime, s in points.items():
            x, y = s[key] or zero_x, s["kl"] or zero_y
            kls = [v for v in s["kl_per_seed"] if v is not None]
            err = [[y - max(min(kls), zero_y)], [max(max(kls), zero_y) - y]] if len(kls) > 1 else None
            ax.errorbar(x, y, yerr=err, fmt="o" if s[key] else "s", capsize=3)
            label = regime if s["kl"] else f"{regime} (KL 0)"
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.axvline(zero_x * 2, color="grey", linestyle=":", linewidth=1)
        where = ax.get_xaxis_transform()  # x in data, y in axes fraction
        ax.text(zero_x, 0.01, "0 B\n(no hints)", transform=where, fontsize=7, color="grey", ha="center")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"hint bytes per token, {title}")
        ax.set_ylabel("KL(rollout || train) per token, mean over steps and seeds")
        ax.grid(alpha=0.3, which="both")
    fig.suptitle("Rollout/training mismatch against hint storage (squares: no hints; bars: min-max over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(plt, results: dict[str, list[dict]], path: str) -> None:
    """Reward (trailing mean) and greedy test accuracy by step: the seed mean as a line, the band between the lowest
    and the highest seed shaded."""
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    for i, (regime, runs) in enumerate(results.items()):
        color = f"C{i % 10}"
        n = max(len(steps_of(r)) for r in runs)
        window = max(1, n // 20)
        for ax, per_seed in [
            (axes[0], [dict(zip(*(lambda x, y: (x, smooth(y, window)))(*curve([r], "reward")), strict=True))
                       for r in runs]),
            (axes[1], [dict(zip(*curve([r], ACC, evals=True), strict=True)) for r in runs]),
        ]:  # fmt: skip
            x = sorted(set.intersection(*(set(c) for c in per_seed)))
            ys = [[c[step] for c in per_seed] for step in x]
            ax.plot(x, [sum(y) / len(y) for y in ys], color=color, label=f"{regime} ({len(runs)} seeds)",
                    marker="o" if ax is axes[1] else None, markersize=3)  # fmt: skip
            if len(runs) > 1:
                ax.fill_between(x, [min(y) for y in ys], [max(y) for y in ys], color=color, alpha=0.15)
    axes[0].set_title("reward (trailing mean over 5% of the steps; band: min-max over seeds)")
    axes[1].set_title("greedy test accuracy, rollout precision (band: min-max over seeds)")
    for ax in axes:
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    {"warm": warm, "grpo": grpo, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
