# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""GRPO on a MoE model with an FP4 rollout: the regimes side by side, from one warm start and one seed.

    python examples/grpo.py                                  # offline: tiny Qwen3 MoE, all four regimes (CPU ok)
    python examples/grpo.py --rollout fp4,trace              # a comma list of regimes
    python examples/grpo.py --rollout trace --report-to tensorboard
    python examples/grpo.py --model /path/Qwen3-30B-A3B --dataset openai/gsm8k --rollout fp4,trace \
        --max-completion-length 512 --gradient-checkpointing

Regimes (`--rollout`, default `all`):
    bf16   BF16 rollout, BF16 training: no FP4 anywhere, the baseline
    naive  FP4 rollout, BF16 training of the masters (`TraceFP4Config(qat=False)`): naive FP4
    fp4    FP4 rollout, FP4 QAT training, no hints, no routing replay
    trace  FP4 rollout, QAT with TRACE hints and routing replay

Every regime loads the same warm weights, uses the same seed (same prompts, same sampling seeds) and the same
settings, so the differences in the table and the plot come from the regime alone.

Where the mismatch comes from. TRACE removes the part of the rollout/training mismatch that FP4 rounding amplifies:
the rollout and the training forward compute slightly different activations (different kernels), and a value near
an FP4 rounding boundary then lands on different grid points. On CUDA that happens by itself: `generate` runs the
fused Triton experts and training the torch grouped GEMMs. On CPU both sides run the same torch kernels and, row by
row, compute bit-identical values, so there would be nothing for TRACE to remove. The CPU default therefore
recreates the GPU's situation with two choices (`--rollout-attention auto`): BF16 weights (`--dtype bf16`), where
one rounding step is ~0.4% and a differently summed value often rounds differently, and a rollout whose attention
runs transformers' eager kernel while training runs SDPA (mathematically the same, summed in another order). The
two kernels differ by an ulp here and there, as the GPU's do; `--rollout-attention same` turns that off (then CPU
rollout and training agree to ~1e-7 and every regime looks alike).

With no `--model`, a tiny Qwen3 MoE from `trace_hf.testing` is warmed up with a short supervised run (fp32, no
quantization) on single-digit addition ("Q: 3+4\\nA:" -> " 7"), so that rewards are neither all zero nor all one,
and cached under `<output-dir>/sft-warm/` for reruns. Under several processes the main process warms up and the
others wait for it.

Writes, under `<output-dir>/<run-name>/` (run name: `--run-name`, default the start time; an existing run is
never overwritten without `--overwrite`): `<regime>/metrics.json` (TRL's log history; TensorBoard or W&B logs too
with `--report-to`), `summary.json`, `table.md` and `grpo.png` (all regimes overlaid), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time


REGIMES = {
    "bf16": "BF16 rollout, BF16 training",
    "naive": "FP4 rollout, BF16 training (naive)",
    "fp4": "FP4 rollout, QAT, no hints",
    "trace": "TRACE: QAT + hints + routing replay",
}
# The trainer's metric names: TRL's `sampling/*` where TRL logs the same quantity, `trace/*` for TRACE's own.
METRICS = {
    "gap_mean": ("sampling/sampling_logp_difference/mean",),
    "gap_max": ("sampling/sampling_logp_difference/max",),
    "kl": ("trace/kl_rollout_train",),
    "flips": ("trace/hint_flip_rate",),
    "routing": ("trace/routing_mismatch",),
}


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
        default="all",
        help=f"regimes to run, 'all' or a comma list of {', '.join(REGIMES)} (see above)",
    )
    p.add_argument("--output-dir", default="outputs/grpo")
    p.add_argument("--run-name", default=None, help="folder under --output-dir; default: the start time")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --run-name folder")
    p.add_argument("--max-steps", type=int, default=40, help="GRPO steps per regime")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype", choices=["bf16", "fp32"], default="bf16", help="weights dtype (bf16: where FP4 mismatch shows)"
    )
    p.add_argument(
        "--rollout-attention",
        choices=["auto", "eager", "same"],
        default="auto",
        help="eager: the rollout computes attention with the eager kernel, training with SDPA (different kernels, "
        "as on the GPU); same: one kernel for both; auto: eager on CPU, same on CUDA",
    )
    p.add_argument(
        "--rollout-engine",
        choices=["auto", "engine", "generate"],
        default="auto",
        help="TraceGRPOConfig.rollout_engine: the CUDA-graph decode engine, model.generate, or auto",
    )
    p.add_argument("--learning-rate", type=float, default=3e-4)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=8, help="distinct prompts per optimizer step")
    p.add_argument("--max-completion-length", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--no-importance-sampling", action="store_true", help="turn off the IS correction")
    p.add_argument("--hint-layers", type=int, default=None, help="TraceFP4Config.hint_layers (default: half)")
    p.add_argument("--kv-cache", default="nvfp4", help="TraceFP4Config.kv_cache: nvfp4, mxfp4 or none")
    p.add_argument("--sft-steps", type=int, default=100, help="warm-up steps for the default tiny model")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest for the tiny model)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="on for large models; off by default")
    p.add_argument(
        "--report-to",
        default="none",
        help="TRL/transformers' report_to: none, tensorboard, wandb, all, or a comma list (offline: tensorboard)",
    )
    p.add_argument("--logging-steps", type=int, default=1, help="log (and plot) every N steps")
    args = p.parse_args(argv)
    names = list(REGIMES) if args.rollout == "all" else [r.strip() for r in args.rollout.split(",") if r.strip()]
    bad = [r for r in names if r not in REGIMES]
    if bad or not names:
        p.error(f"--rollout {args.rollout!r}: use 'all' or a comma list of {', '.join(REGIMES)}")
    args.regimes = list(dict.fromkeys(names))
    args.report_to = [r.strip() for r in args.report_to.split(",")] if "," in args.report_to else args.report_to
    return args


def one_gpu_unless_launched() -> None:
    """One process on several GPUs would make the Trainer wrap the model in DataParallel, which GRPO cannot run.

    Use the first GPU and say how to use them all (a launcher starts one process per GPU).
    """
    if "WORLD_SIZE" in os.environ or os.environ.get("TRACE_GRPO_ONE_GPU"):
        return
    import torch

    n = torch.cuda.device_count()
    if n <= 1:
        return
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    print(
        f"{n} GPUs and one process: running on GPU {first} only. For all {n}, launch one process per GPU: "
        f"`torchrun --nproc_per_node {n} examples/grpo.py ...` or `accelerate launch --multi_gpu --num_processes {n} "
        "examples/grpo.py ...`.",
        flush=True,
    )
    # CUDA has not been initialised yet, but torch has counted the devices: start afresh with one visible.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": first, "TRACE_GRPO_ONE_GPU": "1"}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


# ----------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------


def load_dataset(name: str, seed: int):
    from trace_hf.data import addition_dataset, load_math_dataset, to_grpo_dataset

    if name == "offline-addition":
        ds = addition_dataset(seed)
    elif name == "offline-arithmetic":
        ds = load_math_dataset(None, "train", seed=seed)
    else:
        ds = load_math_dataset(name, "train")
    return to_grpo_dataset(ds)


def target_completion(answer: str) -> str:
    """The short answer the warm-up teaches: " N" (the final number of a GSM8K-style answer)."""
    from trace_hf.data import extract_final_number

    return " " + extract_final_number(answer)


# ----------------------------------------------------------------------------------------------------------
# SFT warm-up of the default tiny model
# ----------------------------------------------------------------------------------------------------------


def sft_warmup(out_dir: str, dataset, steps: int, seed: int) -> str:
    """Build the tiny Qwen3 MoE and teach it the task's answer format (and some answers) with a plain loop.

    fp32 and no quantization: the warm-up only needs to make rewards non-zero; every regime then starts from the
    same weights, and QAT is part of what GRPO does. Cached: reruns load `out_dir`.
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
    tmp = f"{out_dir}.tmp"  # written whole, then renamed: a reader never sees half a checkpoint
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    print(f"SFT warm-up: {steps} steps in {time.time() - t0:.0f}s (final loss {out.loss.item():.3f}), {out_dir}")
    return out_dir


# ----------------------------------------------------------------------------------------------------------
# The CPU mismatch: rollout and training attention on different kernels
# ----------------------------------------------------------------------------------------------------------

SPLIT_ATTENTION = "rollout_eager_train_sdpa"


def _eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Textbook attention (matmul, fp32 softmax, matmul): the same math as SDPA, summed in another order."""
    import torch

    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[-2]]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def register_split_attention() -> str:
    """Register an attention implementation that runs eager in eval mode (the rollout) and SDPA in training."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    def attention(module, *args, **kwargs):
        return (sdpa_attention_forward if module.training else _eager_attention)(module, *args, **kwargs)

    AttentionInterface.register(SPLIT_ATTENTION, attention)
    AttentionMaskInterface.register(SPLIT_ATTENTION, eager_mask)  # additive float masks suit both kernels
    return SPLIT_ATTENTION


# ----------------------------------------------------------------------------------------------------------
# GRPO
# ----------------------------------------------------------------------------------------------------------


def compact_progress_callback():
    """TRL's progress bar with the step's reward and log-prob gap beside it, instead of a metrics dict per step."""
    from transformers.trainer_callback import ProgressCallback

    class CompactProgress(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or self.training_bar is None or not logs:
                return
            parts = []
            if "reward" in logs:
                parts.append(f"reward {logs['reward']:.3f}")
            gap = next((logs[k] for k in METRICS["gap_mean"] if k in logs), None)
            if gap is not None:
                parts.append(f"|dlogp| {gap:.2e}")
            if parts:
                self.training_bar.set_postfix_str(", ".join(parts), refresh=False)

    return CompactProgress()


def build_trainer(args, regime: str, model_path: str, dataset, run_dir: str, attn: str | None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from trace_hf import TraceFP4Config, TraceGRPOConfig, TraceGRPOTrainer
    from trace_hf.data import arithmetic_reward

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    quant = None
    if regime != "bf16":
        kv = None if args.kv_cache.lower() == "none" else args.kv_cache
        quant = TraceFP4Config(kv_cache=kv, hint_layers=args.hint_layers, qat=regime != "naive")
    extra = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, quantization_config=quant, **extra)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    trace = regime == "trace"
    config = TraceGRPOConfig(
        output_dir=run_dir,
        rollout_precision="bf16" if regime == "bf16" else "fp4",
        rollout_engine=args.rollout_engine,
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
        logging_steps=args.logging_steps,
        save_strategy="no",
        report_to=args.report_to,
        run_name=f"{os.path.basename(os.path.dirname(run_dir))}/{regime}",
        seed=args.seed,
        bf16=False,  # no autocast: the weights are already in the dtype asked for
        activation_checkpointing=args.gradient_checkpointing,
        use_cpu=not torch.cuda.is_available(),
        dataloader_pin_memory=torch.cuda.is_available(),
    )
    trainer = TraceGRPOTrainer(
        model=model, reward_funcs=arithmetic_reward, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(compact_progress_callback())
    trainer.pop_callback(PrinterCallback)  # the dict-per-step printer, used when tqdm is off
    return trainer


def first_of(entry: dict, names) -> float | None:
    return next((entry[k] for k in names if k in entry), None)


def summarize(history: list[dict], regime: str) -> dict:
    steps = [h for h in history if "reward" in h]
    rewards = [h["reward"] for h in steps]
    k = max(1, min(5, len(rewards) // 3))
    summary = {
        "regime": regime,
        "steps": len(steps),
        "reward_first": sum(rewards[:k]) / k if rewards else float("nan"),
        "reward_last": sum(rewards[-k:]) / k if rewards else float("nan"),
        "reward_window": k,
    }
    for name, keys in METRICS.items():
        vals = [v for v in (first_of(h, keys) for h in steps) if v is not None]
        if vals:
            summary[name] = max(vals) if name == "gap_max" else sum(vals) / len(vals)
    return summary


def table(summaries: list[dict]) -> str:
    """A Markdown table, one row per regime (the console prints the same text).

    logp gap: |log p_train - log p_rollout| per completion token (mean over the run, and its largest); KL: the
    rollout-training KL per token; flip rate: hinted elements whose nearest rounding in training differs from the
    rollout's FP4 code; routing mismatch: (token, MoE layer) pairs whose own top-k differs from the rollout's.
    """
    cols = [
        ("regime", lambda s: REGIMES[s["regime"]]),
        ("reward first -> last", lambda s: f"{s['reward_first']:.3f} -> {s['reward_last']:.3f}"),
        ("mean logp gap", lambda s: _num(s.get("gap_mean"))),
        ("max logp gap", lambda s: _num(s.get("gap_max"))),
        ("KL rollout/train", lambda s: _num(s.get("kl"))),
        ("hint flip rate", lambda s: _num(s.get("flips"))),
        ("routing mismatch", lambda s: _num(s.get("routing"))),
        ("train s", lambda s: f"{s['train_s']:.0f}"),
    ]
    rows = [[name for name, _ in cols]] + [[fn(s) for _, fn in cols] for s in summaries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)


def _num(v) -> str:
    return "n/a" if v is None else f"{v:.3g}"


def plot(histories: dict[str, list[dict]], path: str, title: str) -> None:
    """All regimes overlaid, one panel per metric that some regime logged; gaps and KL on log axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward", ("reward",), "mean reward", False),
        ("mean |log p_train - log p_rollout|", METRICS["gap_mean"], "nats per token (log)", True),
        ("KL(rollout || train)", METRICS["kl"], "nats per token (log)", True),
        ("hint flip rate (nearest rounding != rollout's)", METRICS["flips"], "fraction of elements (log)", True),
        ("routing mismatch (own top-k != rollout's)", METRICS["routing"], "fraction of (token, layer) (log)", True),
    ]

    def series(regime, keys, log):
        pts = [(h["step"], first_of(h, keys)) for h in histories[regime] if "reward" in h]
        pts = [(x, y) for x, y in pts if y is not None]
        return [(x, y if (y > 0 or not log) else float("nan")) for x, y in pts]  # log axes cannot show 0

    panels = [p for p in panels if any(any(y == y for _, y in series(r, p[1], p[3])) for r in histories)]
    ncols = min(3, len(panels))
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.remove()
    for ax, (name, keys, ylabel, log) in zip(axes.flat, panels, strict=False):
        for i, regime in enumerate(histories):
            pts = series(regime, keys, log)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=".", ms=3, lw=1.2, color=f"C{i}", label=REGIMES[regime])
        if log:
            ax.set_yscale("log")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both" if log else "major")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def prepare_run_dir(args, state) -> str:
    """`<output-dir>/<run-name>`, the same on every process; an existing one is refused unless --overwrite."""
    from accelerate.utils import broadcast_object_list

    name = [args.run_name or time.strftime("%Y%m%d-%H%M%S")]
    if state.num_processes > 1:
        broadcast_object_list(name)  # the main process's clock names the run for all
    run_dir = os.path.join(args.output_dir, name[0])
    if os.path.exists(run_dir) and not args.overwrite:
        sys.exit(f"{run_dir} exists: pass another --run-name, or --overwrite to replace it.")
    state.wait_for_everyone()
    if state.is_main_process:
        if os.path.exists(run_dir):
            shutil.rmtree(run_dir)
        os.makedirs(run_dir)
    state.wait_for_everyone()
    return run_dir


def main(argv=None) -> dict:
    args = parse_args(argv)
    one_gpu_unless_launched()
    import torch
    from accelerate import PartialState
    from transformers import set_seed

    torch.set_num_threads(args.threads)
    state = PartialState(cpu=not torch.cuda.is_available())  # as TraceGRPOConfig(use_cpu=...) will: one state
    run_dir = prepare_run_dir(args, state)
    t0 = time.time()
    dataset = load_dataset(args.dataset, args.seed)
    model_path = args.model
    if model_path is None:
        key = f"{args.dataset}-seed{args.seed}-steps{args.sft_steps}"
        with state.main_process_first():  # the main process trains and saves; the others then load its weights
            model_path = sft_warmup(os.path.join(args.output_dir, "sft-warm", key), dataset, args.sft_steps, args.seed)
    mode = args.rollout_attention
    if mode == "auto":
        mode = "same" if torch.cuda.is_available() else "eager"
    attn = register_split_attention() if mode == "eager" else None

    histories, summaries = {}, []
    for regime in args.regimes:
        set_seed(args.seed)
        if state.is_main_process:
            print(f"\n== {regime}: {REGIMES[regime]}", flush=True)
        regime_dir = os.path.join(run_dir, regime)
        trainer = build_trainer(args, regime, model_path, dataset, regime_dir, attn)
        t = time.time()
        trainer.train()
        history = trainer.state.log_history
        histories[regime] = history
        summary = summarize(history, regime)
        summary["train_s"] = time.time() - t
        summaries.append(summary)
        if state.is_main_process:
            with open(os.path.join(regime_dir, "metrics.json"), "w") as f:
                json.dump(history, f, indent=1)
        del trainer
    if not state.is_main_process:  # one process reports
        return {}

    text = table(summaries)
    with open(os.path.join(run_dir, "table.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump({"args": vars(args), "regimes": summaries}, f, indent=1)
    name = os.path.basename(os.path.normpath(args.model)) if args.model else "tiny Qwen3 MoE (SFT-warmed)"
    device = "CUDA" if torch.cuda.is_available() else "CPU"
    attention = {"eager": "eager rollout / SDPA training attention", "same": "one attention kernel"}[mode]
    title = (
        f"GRPO on {name}: rollout vs training by regime\n"
        f"{args.dtype} weights, {device}, {attention}, {args.max_steps} steps, seed {args.seed}"
    )
    png = os.path.join(run_dir, "grpo.png")
    plot(histories, png, title)
    print(
        f"\n{text}\n\n{time.time() - t0:.0f}s in all. Written to {run_dir}: table.md, summary.json, grpo.png, "
        "<regime>/metrics.json"
    )
    return {"run_dir": run_dir, "regimes": summaries}


if __name__ == "__main__":
    main()
