# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The paper's comparison at small scale: does FP4 with hints train like BF16, and better than naive FP4?

    python examples/study/study.py warm   --out outputs/study                       # SFT-warm the ~100M MoE
    python examples/study/study.py grpo   --out outputs/study --regime trace_replay # one regime (GRPO + eval)
    python examples/study/study.py report --out outputs/study                       # table + plots

Regimes (same warm start, steps, seeds and data):

    bf16          BF16 rollout, BF16 training (plain model); its FP4 evaluation is the PTQ baseline
    fp4_naive     FP4 rollout, BF16 training (TraceFP4Config(qat=False)), no hints, no replay
    fp4_qat       FP4 rollout, QAT, no hints, no replay
    trace         FP4 rollout, QAT, hints on the last half of the MoE layers
    trace_replay  trace + routing replay
    trace_replay_h25 / trace_replay_h100   the layer ablation: hints on the last 25% / 100% of the MoE layers

Every run writes `<out>/<regime>/result.json`: TRL's log history, final test accuracy with FP4 inference (the
packed rollout path) and with BF16 inference (the same master weights, unquantized), and wall time.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time


REGIMES = {
    # name: (quantized, qat, trace_hints, routing_replay, hint fraction)
    "bf16": (False, False, False, False, 0.0),
    "fp4_naive": (True, False, False, False, 0.5),
    "fp4_qat": (True, True, False, False, 0.5),
    "trace": (True, True, True, False, 0.5),
    "trace_replay": (True, True, True, True, 0.5),
    "trace_replay_h25": (True, True, True, True, 0.25),
    "trace_replay_h100": (True, True, True, True, 1.0),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["warm", "grpo", "report"])
    p.add_argument("--out", default="outputs/study")
    p.add_argument("--regime", choices=list(REGIMES), default="trace_replay")
    p.add_argument("--size", choices=["small", "tiny"], default="small", help="small: ~100M MoE; tiny: CPU smoke")
    p.add_argument("--sft-steps", type=int, default=600)
    p.add_argument("--steps", type=int, default=30, help="GRPO steps per regime")
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=96, help="worked answers need ~60-90")
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--eval-problems", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def model_config(size: str, tokenizer):
    """~100M parameters (8 MoE layers, 32 experts top-4, hidden 512) or the tiny test model."""
    from trace_hf.testing import tiny_config

    if size == "tiny":
        return tiny_config("qwen3_moe", tokenizer=tokenizer)
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


def data(seed: int):
    from trace_hf.data import arithmetic_dataset, to_grpo_dataset

    ds = arithmetic_dataset(n_train=4096, n_test=512, seed=seed, max_operand=12)
    return to_grpo_dataset(ds["train"]), to_grpo_dataset(ds["test"])


def device_and_dtype():
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


# ----------------------------------------------------------------------------------------------------------
# Warm-up
# ----------------------------------------------------------------------------------------------------------


def warm(args) -> None:
    """SFT on the worked answers until the model solves a fraction of the problems; saves `<out>/warm`."""
    import torch
    from transformers import AutoModelForCausalLM, set_seed

    from trace_hf.testing import build_char_tokenizer

    set_seed(args.seed)
    dev, dtype = device_and_dtype()
    tok = build_char_tokenizer()
    model = AutoModelForCausalLM.from_config(model_config(args.size, tok), dtype=torch.float32).to(dev)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    train, test = data(args.seed)
    texts = [p + " " + a + tok.eos_token for p, a in zip(train["prompt"], train["answer"], strict=True)]
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-4, total_steps=args.sft_steps, pct_start=0.1)
    g = torch.Generator().manual_seed(args.seed)
    tok.padding_side = "right"  # SFT batches: no fully masked (pad) query rows
    t0, skipped = time.time(), 0
    model.train()
    for step in range(args.sft_steps):
        idx = torch.randint(len(texts), (64,), generator=g).tolist()
        enc = tok([texts[i] for i in idx], return_tensors="pt", padding=True).to(dev)
        labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
        loss = model(**enc, labels=labels).loss  # fp32 weights and compute: the warm-up must not diverge
        if not torch.isfinite(loss):
            skipped += 1
            opt.zero_grad(set_to_none=True)
            continue
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == args.sft_steps - 1:
            print(f"SFT step {step:5d} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
    tok.padding_side = "left"
    print(f"SFT: {skipped} non-finite steps skipped")
    model = model.to(dtype)
    path = os.path.join(args.out, "warm")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    acc = evaluate(model, tok, test, args.eval_problems)
    result = {"sft_steps": args.sft_steps, "wall_s": time.time() - t0, "test_accuracy_bf16": acc}
    with open(os.path.join(args.out, "warm.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))


def evaluate(model, tokenizer, test, n: int, batch: int = 128, max_new_tokens: int = 96) -> float:
    """Greedy accuracy on the first `n` test problems (the arithmetic reward on the completion)."""
    import torch

    from trace_hf.data import arithmetic_reward

    was_training = model.training
    model.eval()
    prompts, answers = test["prompt"][:n], test["answer"][:n]
    correct = 0.0
    for i in range(0, len(prompts), batch):
        enc = tokenizer(prompts[i : i + batch], return_tensors="pt", padding=True).to(model.device)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
        correct += sum(arithmetic_reward(texts, answers[i : i + batch]))
    model.train(was_training)
    return correct / len(prompts)


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


def fp4_copy(model, hint_layers=None):
    """The same master weights with FP4 experts and KV cache (FP4 inference; PTQ for a BF16-trained policy)."""
    from trace_hf import TraceFP4Config
    from trace_hf.quantizer import quantize_model

    q = plain_copy(model)
    return quantize_model(q, TraceFP4Config(hint_layers=hint_layers))


# ----------------------------------------------------------------------------------------------------------
# GRPO
# ----------------------------------------------------------------------------------------------------------


def grpo(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from trace_hf import TraceFP4Config, TraceGRPOConfig, TraceGRPOTrainer
    from trace_hf.data import arithmetic_reward
    from trace_hf.experts import fp4_experts

    quantized, qat, hints, replay, fraction = REGIMES[args.regime]
    set_seed(args.seed)
    dev, dtype = device_and_dtype()
    warm_path = os.path.join(args.out, "warm")
    tok = AutoTokenizer.from_pretrained(warm_path)
    n_moe = model_config(args.size, tok).num_hidden_layers
    hint_layers = max(1, round(fraction * n_moe)) if quantized else None
    quant = TraceFP4Config(qat=qat, hint_layers=hint_layers) if quantized else None
    model = AutoModelForCausalLM.from_pretrained(warm_path, dtype=dtype, quantization_config=quant).to(dev)
    train, test = data(args.seed)
    run_dir = os.path.join(args.out, args.regime)
    config = TraceGRPOConfig(
        output_dir=run_dir,
        rollout_precision="fp4" if quantized else "bf16",
        trace_hints=hints,
        routing_replay=replay,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=0.0,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=dev.type == "cpu",
        disable_tqdm=True,
    )
    trainer = TraceGRPOTrainer(
        model=model, reward_funcs=arithmetic_reward, args=config, train_dataset=train, processing_class=tok
    )
    t0 = time.time()
    trainer.train()
    wall = time.time() - t0
    model = trainer.model
    result = {
        "regime": args.regime,
        "hint_layers": [m.moe_index for m in fp4_experts(model) if m.hinted] if quantized and hints else [],
        "seed": args.seed,
        "steps": args.steps,
        "train_wall_s": wall,
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "history": trainer.state.log_history,
        "test_accuracy_fp4": evaluate(model if quantized else fp4_copy(model), tok, test, args.eval_problems),
        "test_accuracy_bf16": evaluate(plain_copy(model), tok, test, args.eval_problems),
    }
    with open(os.path.join(run_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "history"}))


# ----------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------

COLUMNS = [
    ("sampling/sampling_logp_difference/mean", "mean |dlogp|"),
    ("sampling/sampling_logp_difference/max", "max |dlogp|"),
    ("trace/kl_rollout_train", "KL roll/train"),
    ("trace/hint_flip_rate", "flip rate"),
    ("trace/routing_mismatch", "routing mismatch"),
]


def report(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = {}
    for regime in REGIMES:
        path = os.path.join(args.out, regime, "result.json")
        if os.path.exists(path):
            with open(path) as f:
                results[regime] = json.load(f)
    if not results:
        raise SystemExit(f"No results under {args.out}: run `study.py grpo --regime ...` first.")
    lines = [
        "| regime | "
        + " | ".join(c for _, c in COLUMNS)
        + " | reward first5 -> last5 | test acc FP4 | test acc BF16 |",
        "|---" * (len(COLUMNS) + 4) + "|",
    ]
    for regime, r in results.items():
        steps = [h for h in r["history"] if "reward" in h]
        cells = []
        for key, _ in COLUMNS:
            vals = [h[key] for h in steps if key in h]
            agg = max(vals) if key.endswith("max") and vals else (sum(vals) / len(vals) if vals else None)
            cells.append("n/a" if agg is None else f"{agg:.4g}")
        rw = [h["reward"] for h in steps]
        k = min(5, len(rw))
        cells.append(f"{sum(rw[:k]) / k:.3f} -> {sum(rw[-k:]) / k:.3f}")
        cells += [f"{r['test_accuracy_fp4']:.3f}", f"{r['test_accuracy_bf16']:.3f}"]
        lines.append(f"| {regime} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table + "\n")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for regime, r in results.items():
        steps = [h for h in r["history"] if "reward" in h]
        x = [h["step"] for h in steps]
        axes[0].plot(x, [h["reward"] for h in steps], label=regime)
        axes[1].plot(x, [h.get("sampling/sampling_logp_difference/mean", float("nan")) for h in steps], label=regime)
        axes[2].plot(x, [h.get("trace/kl_rollout_train", float("nan")) for h in steps], label=regime)
    for ax, title in zip(axes, ["reward", "mean |logp_train - logp_rollout|", "KL(rollout || train)"], strict=True):
        ax.set_title(title)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "study.png"), dpi=110)
    print(f"wrote {os.path.join(args.out, 'table.md')} and {os.path.join(args.out, 'study.png')}")


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    {"warm": warm, "grpo": grpo, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
