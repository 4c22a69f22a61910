# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""GRPO on a MoE model with an FP4 rollout: the BF16 baseline, FP4 QAT without hints, and TRACE.

    python examples/grpo.py                                  # offline: tiny Qwen3 MoE, SFT warm-up, TRACE
    python examples/grpo.py --rollout fp4                    # FP4 rollout + QAT, no hints, no routing replay
    python examples/grpo.py --rollout bf16                   # unquantized baseline
    python examples/grpo.py --model /path/Qwen3-30B-A3B --dataset openai/gsm8k --dtype bf16 \
        --max-completion-length 512 --gradient-checkpointing

With no `--model`, a tiny Qwen3 MoE from `trace_hf.testing` is built and warmed up with a short supervised run on
the offline task (so that rewards are not all zero and can move), and cached under `<output-dir>/sft-warm` so that
reruns (and the other `--rollout` settings) start from the same weights. The offline default task is single-digit
addition ("Q: 3+4\\nA:" -> " 7"): short prompts and completions keep a CPU run to a few minutes.

Writes `<output-dir>/<rollout>/metrics.json` (TRL's log history), a plot `<output-dir>/<rollout>/grpo.png` of reward
and mismatch metrics by step, and prints a summary table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Qwen3 MoE / Qwen3.5 MoE path; default: SFT-warmed tiny model")
    p.add_argument(
        "--dataset",
        default="offline-addition",
        help="'offline-addition' (default: single-digit addition), 'offline-arithmetic' (word problems), "
        "'openai/gsm8k', a save_to_disk folder, or any load_dataset name with question/answer columns",
    )
    p.add_argument(
        "--rollout",
        choices=["bf16", "fp4", "trace"],
        default="trace",
        help="bf16: unquantized; fp4: FP4 rollout + QAT, no hints/replay; trace: FP4 + hints + routing replay",
    )
    p.add_argument("--max-steps", type=int, default=80)
    p.add_argument("--output-dir", default="outputs/grpo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype", choices=["bf16", "fp32"], default="fp32", help="weights dtype (fp32: faster and steadier on CPU)"
    )
    p.add_argument("--learning-rate", type=float, default=3e-4)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=16, help="distinct prompts per optimizer step")
    p.add_argument("--max-completion-length", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--no-importance-sampling", action="store_true", help="turn off the IS correction")
    p.add_argument("--hint-layers", type=int, default=None, help="TraceFP4Config.hint_layers (default: half)")
    p.add_argument("--kv-cache", default="nvfp4", help="TraceFP4Config.kv_cache: nvfp4, mxfp4 or none")
    p.add_argument("--sft-steps", type=int, default=100, help="warm-up steps for the default tiny model")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest for the tiny model)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="on for large models; off by default")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------


def addition_dataset(seed: int = 0, max_operand: int = 9):
    """Every single-digit addition "a+b" once (100 rows), shuffled, in GSM8K's question/answer columns."""
    from datasets import Dataset

    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    return Dataset.from_dict(
        {
            "question": [f"{a}+{b}" for a, b in pairs],
            "answer": [f"{a}+{b}=<<{a}+{b}={a + b}>>\n#### {a + b}" for a, b in pairs],
        }
    )


def load_dataset(name: str, seed: int):
    from trace_hf.testing import load_math_dataset, to_grpo_dataset

    if name == "offline-addition":
        ds = addition_dataset(seed)
    elif name == "offline-arithmetic":
        ds = load_math_dataset(None, "train", seed=seed)
    else:
        ds = load_math_dataset(name, "train")
    return to_grpo_dataset(ds)


def target_completion(answer: str) -> str:
    """The short answer the warm-up teaches: " N" (the final number of a GSM8K-style answer)."""
    from trace_hf.testing import extract_final_number

    return " " + extract_final_number(answer)


# ----------------------------------------------------------------------------------------------------------
# SFT warm-up of the default tiny model
# ----------------------------------------------------------------------------------------------------------


def sft_warmup(out_dir: str, dataset, steps: int, seed: int) -> str:
    """Build the tiny Qwen3 MoE and teach it the task's answer format (and some answers) with a plain loop.

    fp32 and no quantization: the warm-up only needs to make rewards non-zero; the FP4 runs then start from the
    same weights as the BF16 baseline, and QAT is part of what GRPO does. Cached: reruns load `out_dir`.
    """
    import torch

    from trace_hf import testing

    if os.path.exists(os.path.join(out_dir, "config.json")):
        print(f"SFT warm-up: reusing {out_dir}")
        return out_dir
    t0 = time.time()
    tok = testing.build_char_tokenizer()
    model = testing.tiny_model("qwen3_moe", tokenizer=tok, seed=seed, dtype=torch.float32)
    rows = []
    for prompt, answer in zip(dataset["prompt"], dataset["answer"], strict=True):
        p = tok(prompt)["input_ids"]
        c = tok(target_completion(answer))["input_ids"] + [tok.eos_token_id]
        rows.append((p, c))
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, c) in enumerate(rows):  # left padded, as generation sees prompts
        seq = p + c
        ids[i, width - len(seq) :] = torch.tensor(seq)
        mask[i, width - len(seq) :] = 1
        labels[i, width - len(c) :] = torch.tensor(c)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    batch = min(64, len(rows))
    for step in range(steps):
        idx = torch.randperm(len(rows), generator=gen)[:batch]
        out = model(input_ids=ids[idx], attention_mask=mask[idx], position_ids=positions[idx], labels=labels[idx])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            print(f"SFT warm-up step {step:4d}  loss {out.loss.item():.3f}")
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    print(f"SFT warm-up: {steps} steps in {time.time() - t0:.0f}s, saved to {out_dir}")
    return out_dir


# ----------------------------------------------------------------------------------------------------------
# GRPO
# ----------------------------------------------------------------------------------------------------------


def build_trainer(args, model_path: str, dataset, run_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trace_hf import TraceFP4Config, TraceGRPOConfig, TraceGRPOTrainer
    from trace_hf.testing import arithmetic_reward

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    quant = None
    if args.rollout != "bf16":
        kv = None if args.kv_cache.lower() == "none" else args.kv_cache
        quant = TraceFP4Config(kv_cache=kv, hint_layers=args.hint_layers)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, quantization_config=quant)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    trace = args.rollout == "trace"
    config = TraceGRPOConfig(
        output_dir=run_dir,
        rollout_precision="bf16" if args.rollout == "bf16" else "fp4",
        trace_hints=trace,
        routing_replay=trace,
        rollout_importance_sampling=not args.no_importance_sampling,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=0.0,
        max_steps=args.max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        bf16=False,  # no autocast: the weights are already in the dtype asked for
        gradient_checkpointing=args.gradient_checkpointing,
        use_cpu=not torch.cuda.is_available(),
        dataloader_pin_memory=torch.cuda.is_available(),
    )
    return TraceGRPOTrainer(
        model=model, reward_funcs=arithmetic_reward, args=config, train_dataset=dataset, processing_class=tokenizer
    )


def summarize(history: list[dict], rollout: str) -> dict:
    steps = [h for h in history if "reward" in h]
    rewards = [h["reward"] for h in steps]
    k = max(1, min(5, len(rewards) // 3))
    summary = {
        "rollout": rollout,
        "steps": len(steps),
        "reward/first": rewards[0] if rewards else float("nan"),
        "reward/last": rewards[-1] if rewards else float("nan"),
        f"reward/first{k}_mean": sum(rewards[:k]) / k if rewards else float("nan"),
        f"reward/last{k}_mean": sum(rewards[-k:]) / k if rewards else float("nan"),
    }
    for key in (
        "trace/logp_diff/mean",
        "trace/logp_diff/max",
        "trace/kl_rollout_train",
        "trace/hint_flip_rate",
        "trace/routing_mismatch",
        "trace/is_ratio/mean",
        "trace/hint_bytes_per_token",
    ):
        vals = [h[key] for h in steps if key in h]
        if vals:
            summary[f"{key} (mean)"] = sum(vals) / len(vals)
    return summary


def print_table(summary: dict) -> None:
    width = max(len(k) for k in summary)
    print("\n" + "=" * (width + 16))
    for k, v in summary.items():
        print(f"{k:<{width}}  {v:>12.5g}" if isinstance(v, float) else f"{k:<{width}}  {v!s:>12}")
    print("=" * (width + 16))


def plot(history: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h for h in history if "reward" in h]
    x = [h["step"] for h in steps]
    panels = [
        ("reward", ["reward"]),
        ("log-prob gap (rollout vs train)", ["trace/logp_diff/mean", "trace/kl_rollout_train"]),
        ("mismatch", ["trace/hint_flip_rate", "trace/routing_mismatch"]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    for ax, (name, keys) in zip(axes, panels, strict=True):
        for key in keys:
            ys = [h.get(key) for h in steps]
            if any(y is not None for y in ys):
                ax.plot(x, [float("nan") if y is None else y for y in ys], marker=".", label=key)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch
    from transformers import set_seed

    torch.set_num_threads(args.threads)
    set_seed(args.seed)
    t0 = time.time()
    dataset = load_dataset(args.dataset, args.seed)
    model_path = args.model
    if model_path is None:
        model_path = sft_warmup(os.path.join(args.output_dir, "sft-warm"), dataset, args.sft_steps, args.seed)
    run_dir = os.path.join(args.output_dir, args.rollout)
    os.makedirs(run_dir, exist_ok=True)
    trainer = build_trainer(args, model_path, dataset, run_dir)
    trainer.train()
    history = trainer.state.log_history
    if not trainer.accelerator.is_main_process:  # under accelerate launch, one process reports
        return {}
    with open(os.path.join(run_dir, "metrics.json"), "w") as f:
        json.dump(history, f, indent=1)
    summary = summarize(history, args.rollout)
    summary["wall_time_s"] = time.time() - t0
    print_table(summary)
    png = os.path.join(run_dir, "grpo.png")
    plot(history, png, f"GRPO, rollout={args.rollout}, dtype={args.dtype}")
    print(f"metrics: {os.path.join(run_dir, 'metrics.json')}\nplot:    {png}")
    return summary


if __name__ == "__main__":
    main()
