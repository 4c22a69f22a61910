# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""GRPO on a MoE model with an FP4 rollout: the regimes side by side, from one warm start and one seed.

    python examples/grpo.py                                  # offline: tiny Qwen3 MoE, all four regimes (CPU ok)
    python examples/grpo.py --regimes fp4,trace              # a comma list of regimes
    python examples/grpo.py --regimes trace --report_to tensorboard --learning_rate 1e-4 --num_generations 4
    python examples/grpo.py --config examples/recipes/qwen3_30b_a3b_grpo.yaml   # a real run (see the recipe)
    python examples/grpo.py --config examples/recipes/qwen3_30b_a3b_lora_1gpu.yaml   # the full model on one GPU

The command line is TRL's: `TrlParser` over (`GRPOExampleArguments` below, `TraceGRPOConfig`, TRL's `ModelConfig`),
so every GRPOConfig and TRACE field is a flag (`--per_device_train_batch_size`, `--max_completion_length`,
`--rollout_engine`, `--rollout_importance_sampling false`, ...), a YAML file of the same names works with `--config`
(flags given as well override it), and `--use_peft --lora_target_modules q_proj v_proj` trains LoRA adapters, passed
to the trainer as `peft_config=get_peft_config(model_args)`. The regime sets `rollout_precision`, `trace_hints` and
`routing_replay` of each run itself. `--help` lists every flag.

Regimes (`--regimes`, default `all`):
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
recreates the GPU's situation with two choices (`--rollout_attention auto`): BF16 weights (`--dtype bfloat16`), where
one rounding step is ~0.4% and a differently summed value often rounds differently, and a rollout whose attention
runs transformers' eager kernel while training runs SDPA (mathematically the same, summed in another order). The
two kernels differ by an ulp here and there, as the GPU's do; `--rollout_attention same` turns that off (then CPU
rollout and training agree to ~1e-7 and every regime looks alike).

With no `--model_name_or_path`, a tiny Qwen3 MoE from `trace_hf.testing` is warmed up with a short supervised run (fp32, no
quantization) on single-digit addition ("Q: 3+4\\nA:" -> " 7"), so that rewards are neither all zero nor all one,
and cached under `<output_dir>/sft-warm/` for reruns. Under several processes the main process warms up and the
others wait for it.

Writes, under `<output_dir>/<run_name>/` (`--output_dir`, default `outputs/grpo`; `--run_name`, default the start
time; an existing run is never overwritten without `--overwrite`): `<regime>/metrics.json` (TRL's log history; TensorBoard or W&B logs too
with `--report_to`), `summary.json`, `table.md` and `grpo.png` (all regimes overlaid), and prints the table. With
`--export_fp4 compressed-tensors`, each FP4 regime's trained policy too (`<regime>/policy`, the NVFP4 checkpoint
vLLM and SGLang serve; `trace_fp4` writes trace-hf's own format for `trace_hf.export.load_fp4`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field


# Before torch allocates on CUDA: the allocator then maps memory in pages, so what training frees leaves no fragments
# that the rollout engine's large cache buffers cannot use (at 128K, 56 admitted rows instead of 32 on an H100;
# docs/benchmarks.md). A value the user sets wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

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


@dataclass
class GRPOExampleArguments:
    """The example's own options; everything else is a `TraceGRPOConfig` or `ModelConfig` field."""

    regimes: str = field(
        default="all",
        metadata={"help": f"Regimes to run: 'all' or a comma list of {', '.join(REGIMES)} (see the docstring)."},
    )
    overwrite: bool = field(default=False, metadata={"help": "Replace an existing <output_dir>/<run_name> folder."})
    dataset_name: str = field(
        default="offline-addition",
        metadata={
            "help": "'offline-addition' (single-digit addition), 'offline-arithmetic' (word problems), "
            "'openai/gsm8k', a save_to_disk folder, or any load_dataset name with question/answer columns."
        },
    )
    rollout_attention: str = field(
        default="auto",
        metadata={
            "help": "eager: the rollout computes attention with the eager kernel, training with SDPA (different "
            "kernels, as on the GPU); same: one kernel for both; auto: eager on CPU, same on CUDA.",
            "choices": ["auto", "eager", "same"],
        },
    )
    hint_layers: int | None = field(
        default=None, metadata={"help": "TraceFP4Config.hint_layers (default: half of the MoE layers)."}
    )
    kv_cache: str = field(default="nvfp4", metadata={"help": "TraceFP4Config.kv_cache: nvfp4, mxfp4 or none."})
    freeze_experts: bool = field(
        default=False,
        metadata={
            "help": "Freeze the routed experts: FP4 regimes load them straight into packed FP4 "
            "(TraceFP4Config.freeze_experts: no BF16 masters, no gradients), bf16 keeps them BF16 without gradients; "
            "'all' regimes then leaves out naive, which trains those masters. "
            "With --use_peft this is the full-size model on one GPU (examples/recipes/qwen3_30b_a3b_lora_1gpu.yaml)."
        },
    )
    export_fp4: str = field(
        default="none",
        metadata={
            "help": "Write each FP4 regime's trained policy to <run>/<regime>/policy: 'compressed-tensors' (NVFP4 "
            "W4A4, what vLLM and SGLang serve; LoRA merged, input scales calibrated on task text; needs [serve]), "
            "'trace_fp4' (trace-hf's format, for trace_hf.export.load_fp4) or 'none'. The bf16 regime has no FP4 "
            "experts and is not exported.",
            "choices": ["none", "compressed-tensors", "trace_fp4"],
        },
    )
    sft_steps: int = field(default=100, metadata={"help": "Warm-up steps of the default tiny model."})
    threads: int = field(default=1, metadata={"help": "torch CPU threads (1 is fastest for the tiny model)."})


# The example's defaults where they differ from TRL's (a --config file and flags override them): the offline job.
EXAMPLE_DEFAULTS = {
    "output_dir": "outputs/grpo",
    "max_steps": 40,
    "learning_rate": 3e-4,
    "lr_scheduler_type": "constant",
    "warmup_steps": 0,
    "beta": 0.0,
    "num_generations": 8,
    "per_device_train_batch_size": 64,  # completions per step: 8 prompts x 8 generations
    "max_completion_length": 4,
    "temperature": 1.0,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "seed": 0,
    "bf16": False,  # no autocast: the weights are loaded in the dtype asked for (--dtype)
    "activation_checkpointing": False,  # worth it for large models only
    "dtype": "bfloat16",  # where FP4 mismatch shows
}


def parse_args(argv=None):
    """(GRPOExampleArguments, TraceGRPOConfig, ModelConfig) from TRL's parser; `regimes` becomes a list."""
    import torch
    from trl import ModelConfig, TrlParser

    from trace_hf import TraceGRPOConfig

    parser = TrlParser((GRPOExampleArguments, TraceGRPOConfig, ModelConfig))
    parser.description, parser.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    cuda = torch.cuda.is_available()
    parser.set_defaults_with_config(**EXAMPLE_DEFAULTS, use_cpu=not cuda, dataloader_pin_memory=cuda)
    script, config, model_args = parser.parse_args_and_config(args=argv)
    names = list(REGIMES) if script.regimes == "all" else [r.strip() for r in script.regimes.split(",") if r.strip()]
    if script.regimes == "all" and script.freeze_experts:
        names.remove("naive")  # it trains the BF16 expert masters that frozen experts do not keep (main says so)
    bad = [r for r in names if r not in REGIMES]
    if bad or not names:
        parser.error(f"--regimes {script.regimes!r}: use 'all' or a comma list of {', '.join(REGIMES)}")
    script.regimes = list(dict.fromkeys(names))
    if script.freeze_experts and "naive" in script.regimes:
        parser.error(
            "--freeze_experts keeps no BF16 expert masters, and the naive regime trains exactly those: leave naive "
            "out (--regimes bf16,fp4,trace) or train the experts (no --freeze_experts)."
        )
    if script.export_fp4 == "compressed-tensors":  # refused now, not after the training it would export
        from trace_hf.export.compressed import require_compressed_tensors

        try:
            require_compressed_tensors()
        except ImportError as e:
            parser.error(f"--export_fp4 compressed-tensors: {e}")
    # transformers takes one integration per list entry; also accept TRL's comma form "tensorboard,wandb".
    config.report_to = [r.strip() for entry in config.report_to for r in entry.split(",") if r.strip()]
    return script, config, model_args


def regime_config(argv, regime: str, run_dir: str):
    """The TraceGRPOConfig of one regime: the command line (and --config) plus the regime's own fields. Parsed
    again rather than copied, because GRPOConfig derives fields (generation_batch_size from steps_per_generation)
    that a copy would pass back in as if both were set."""
    trace = regime == "trace"
    extra = ["--output_dir", run_dir, "--run_name", f"{os.path.basename(os.path.dirname(run_dir))}/{regime}"]
    extra += ["--rollout_precision", "bf16" if regime == "bf16" else "fp4"]
    extra += ["--trace_hints", str(trace), "--routing_replay", str(trace)]
    return parse_args([*(sys.argv[1:] if argv is None else argv), *extra])[1]


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


def check_model(model_path: str, revision: str | None, prompt: str, quantized: bool) -> None:
    """Refuse a checkpoint before the first regime spends its time on it: a folder without tokenizer files (transformers
    then gives a tokenizer that encodes every prompt to nothing) or, for the FP4 regimes, a model without fused routed
    experts (`TraceFP4Config` would refuse it only when the first FP4 regime loads it, after the BF16 one has run).
    The experts are looked for on the meta device: no weights are read."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from trace_hf.quant.experts import SUPPORTED_LAYOUTS, is_fused_experts

    if not AutoTokenizer.from_pretrained(model_path, revision=revision)(prompt)["input_ids"]:
        raise SystemExit(
            f"--model_name_or_path {model_path}: its tokenizer encodes the prompt {prompt!r} to no tokens, as the "
            "tokenizer transformers loads from a folder without tokenizer files does. Save the model's tokenizer "
            "beside its weights (tokenizer.save_pretrained(path))."
        )
    if not quantized:
        return
    config = AutoConfig.from_pretrained(model_path, revision=revision)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    if not any(is_fused_experts(m) for m in model.modules()):
        raise SystemExit(
            f"--model_name_or_path {model_path}: {type(model).__name__} (model_type {config.model_type!r}) has no fused "
            f"routed experts for the FP4 regimes to quantize. trace-hf supports {SUPPORTED_LAYOUTS}. Pass such a "
            "checkpoint, or run only the BF16 regime (--regimes bf16)."
        )


def build_trainer(script, args, model_args, regime: str, model_path: str, dataset, attn):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import get_peft_config

    from trace_hf import TraceFP4Config, TraceGRPOTrainer
    from trace_hf.data import arithmetic_reward
    from trace_hf.quant.experts import is_fused_experts

    dtype = model_args.dtype if model_args.dtype in (None, "auto") else getattr(torch, model_args.dtype)
    quant = None
    if regime != "bf16":
        kv = None if script.kv_cache.lower() == "none" else script.kv_cache
        quant = TraceFP4Config(kv_cache=kv, hint_layers=script.hint_layers, qat=regime != "naive",
                               freeze_experts=script.freeze_experts)  # fmt: skip
    attn = attn or model_args.attn_implementation
    extra = {"attn_implementation": attn} if attn else {}
    if model_args.model_name_or_path:
        extra["revision"] = model_args.model_revision  # (TRL 1.16's ModelConfig has no trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, quantization_config=quant, **extra)
    if script.freeze_experts and quant is None:  # the BF16 comparison: the same experts, BF16, without gradients
        for module in model.modules():
            if is_fused_experts(module):
                module.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    trainer = TraceGRPOTrainer(
        model=model,
        reward_funcs=arithmetic_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),  # None unless --use_peft
    )
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(compact_progress_callback())
    trainer.pop_callback(PrinterCallback)  # the dict-per-step printer, used when tqdm is off
    return trainer


def export_policy(trainer, directory: str, fmt: str, dataset, rows: int = 64) -> None:
    """`--export_fp4`: the trained policy as a checkpoint to serve or to start again from. compressed-tensors' W4A4
    scheme needs the experts' input scales, calibrated here on the task's text (prompt and reference answer of the
    first `rows` examples); the LoRA adapters are merged first (trace_fp4 merges them itself)."""
    from accelerate.utils import is_peft_model

    from trace_hf.export import export_fp4

    model, tok = trainer.model, trainer.processing_class
    if fmt == "trace_fp4":
        export_fp4(model, directory)
        tok.save_pretrained(directory)
        return
    if is_peft_model(model):
        model = model.merge_and_unload()
    n = min(rows, len(dataset))
    texts = [p + target_completion(a) for p, a in zip(dataset["prompt"][:n], dataset["answer"][:n], strict=True)]
    batch = tok(texts, return_tensors="pt", padding=True)
    calibration = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    export_fp4(model, directory, format="compressed-tensors", calibration=calibration, tokenizer=tok)


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


def prepare_run_dir(output_dir: str, run_name: str | None, overwrite: bool, state) -> str:
    """`<output_dir>/<run_name>`, the same on every process; an existing one is refused unless --overwrite."""
    from accelerate.utils import broadcast_object_list

    name = [run_name or time.strftime("%Y%m%d-%H%M%S")]
    if state.num_processes > 1:
        broadcast_object_list(name)  # the main process's clock names the run for all
    run_dir = os.path.join(output_dir, name[0])
    if os.path.exists(run_dir) and not overwrite:
        sys.exit(f"{run_dir} exists: pass another --run_name, or --overwrite to replace it.")
    state.wait_for_everyone()
    if state.is_main_process:
        if os.path.exists(run_dir):
            shutil.rmtree(run_dir)
        os.makedirs(run_dir)
    state.wait_for_everyone()
    return run_dir


def main(argv=None) -> dict:
    one_gpu_unless_launched()  # before parsing: building the config may set up the devices
    script, config, model_args = parse_args(argv)
    import torch
    from accelerate import PartialState
    from transformers import set_seed

    if script.freeze_experts and "naive" not in script.regimes:
        print(f"--freeze_experts: regimes {', '.join(script.regimes)} (naive trains the experts' BF16 masters)")

    torch.set_num_threads(script.threads)
    state = PartialState(cpu=config.use_cpu)  # the state the trainers' config will use
    run_dir = prepare_run_dir(config.output_dir, config.run_name, script.overwrite, state)
    t0 = time.time()
    dataset = load_dataset(script.dataset_name, config.seed)
    model_path = model_args.model_name_or_path
    if model_path is not None:
        quantized = any(r != "bf16" for r in script.regimes)
        check_model(model_path, model_args.model_revision, dataset[0]["prompt"], quantized)
    else:
        key = f"{script.dataset_name}-seed{config.seed}-steps{script.sft_steps}"
        with state.main_process_first():  # the main process trains and saves; the others then load its weights
            warm = os.path.join(config.output_dir, "sft-warm", key)
            model_path = sft_warmup(warm, dataset, script.sft_steps, config.seed)
    mode = script.rollout_attention
    if mode == "auto":
        mode = "same" if torch.cuda.is_available() else "eager"
    attn = register_split_attention() if mode == "eager" else None

    histories, summaries = {}, []
    for regime in script.regimes:
        set_seed(config.seed)
        if state.is_main_process:
            print(f"\n== {regime}: {REGIMES[regime]}", flush=True)
        regime_dir = os.path.join(run_dir, regime)
        args = regime_config(argv, regime, regime_dir)
        trainer = build_trainer(script, args, model_args, regime, model_path, dataset, attn)
        if script.export_fp4 != "none" and trainer.is_fsdp_enabled:  # seen on the first regime, before it trains
            raise SystemExit(
                "--export_fp4 under FSDP: each process holds a shard of the experts. Save checkpoints (--save_strategy "
                "steps) and export one in a single process with trace_hf.export.export_fp4."
            )
        t = time.time()
        trainer.train()
        history = trainer.state.log_history
        histories[regime] = history
        summary = summarize(history, regime)
        summary["train_s"] = time.time() - t
        summaries.append(summary)
        if script.export_fp4 != "none" and regime != "bf16":
            if state.is_main_process:
                export_policy(trainer, os.path.join(regime_dir, "policy"), script.export_fp4, dataset)
            state.wait_for_everyone()
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
        args = {
            "script": dataclasses.asdict(script),
            "model": dataclasses.asdict(model_args),
            "config": config.to_dict(),
        }
        json.dump({"args": args, "regimes": summaries}, f, indent=1, default=str)
    name = model_args.model_name_or_path
    name = os.path.basename(os.path.normpath(name)) if name else "tiny Qwen3 MoE (SFT-warmed)"
    device = "CUDA" if torch.cuda.is_available() else "CPU"
    attention = {"eager": "eager rollout / SDPA training attention", "same": "one attention kernel"}[mode]
    title = (
        f"GRPO on {name}: rollout vs training by regime\n"
        f"{model_args.dtype} weights, {device}, {attention}, {config.max_steps} steps, seed {config.seed}"
    )
    png = os.path.join(run_dir, "grpo.png")
    plot(histories, png, title)
    policies = ", <FP4 regime>/policy" if script.export_fp4 != "none" else ""
    print(
        f"\n{text}\n\n{time.time() - t0:.0f}s in all. Written to {run_dir}: table.md, summary.json, grpo.png, "
        f"<regime>/metrics.json{policies}"
    )
    return {"run_dir": run_dir, "regimes": summaries}


if __name__ == "__main__":
    main()
