# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Whole GRPO steps of `TraceGRPOTrainer` on a random Qwen3-30B-A3B-shaped model: what the rollout engine buys.

    python benchmarks/grpo_step.py --out outputs/grpo_step.json                # H200, 8 layers, a few minutes
    python benchmarks/grpo_step.py --smoke --out /tmp/grpo_step_smoke.json     # CPU, tiny model, interpreter
    torchrun --nproc_per_node 2 benchmarks/grpo_step.py --setups engine_fp4 --out ...   # DDP, 64 rows per GPU
    accelerate launch --config_file examples/accelerate/fsdp2.yaml benchmarks/grpo_step.py --setups engine_fp4 \
        --layers 28 --out ...                                                     # FSDP2 over the GPUs

Setups (the same random weights, prompts and TRL settings; one rollout and one optimizer step per GRPO step):
  ``generate_bf16``  the plain model, `model.generate` (what a TRL user gets without vLLM);
  ``engine_bf16``    the plain model, the rollout engine with a BF16 KV cache (the fair baseline);
  ``engine_fp4``     `TraceFP4Config` (W4A4 experts, FP4 KV cache), the engine, hints + routing replay (TRACE).
Batch: ``--prompts`` x ``--num-generations`` rows of ``--prompt-len`` random tokens, completions of
``--completion`` tokens (EOS is a token the random model almost never draws, so they run to length). Reported
per setup: rollout seconds and tokens/s, whole-step seconds (steps after the first, which compiles and captures),
peak memory (per GPU), and the ratios to ``generate_bf16``; with ``--profile`` also the last step's device time
by kernel (``kernels_last_step``: what a rollout spends in prefill, decode and re-packing, and training in what). Under several processes every GPU rolls out its own
64 rows; tokens/s are per GPU and in all (``*_total``), and the main process writes the JSON. Run it as a script so that the installed trace_hf is imported.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (the Triton interpreter)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--setups", default="generate_bf16,engine_bf16,engine_fp4")
    p.add_argument("--profile", action="store_true", help="break the last step's device time down by kernel")
    return p.parse_args(argv)


def word_tokenizer(vocab: int):
    """A tokenizer with one word per id (``<i>``), so any sampled id decodes; no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<3>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<0>", eos_token="<1>", bos_token="<2>",
                                   unk_token="<3>", padding_side="left")  # fmt: skip


def build_model(args, fp4: bool, dev):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from trace_hf import TraceFP4Config
    from trace_hf.quantizer import quantize_model

    if args.smoke:
        shape = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                 "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "vocab_size": 300,
                 "intermediate_size": 64}  # fmt: skip
    else:
        shape = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "vocab_size": 151936,
                 "intermediate_size": 6144}  # fmt: skip
    cfg = Qwen3MoeConfig(num_hidden_layers=args.layers, max_position_embeddings=32768, tie_word_embeddings=False,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2, **shape)  # fmt: skip
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if fp4:
        # Under FSDP2 the QAT weight cache would hold every layer's full dequantized experts on every GPU.
        fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        quantize_model(model, TraceFP4Config(cache_qat_weights=not fsdp))
    return model


class StepTimer:
    """A TrainerCallback that keeps the wall time of every optimizer step."""

    def __init__(self):
        from transformers import TrainerCallback

        timer = self

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                timer._t = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                import torch

                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                timer.steps.append(time.perf_counter() - timer._t)

        self.steps: list[float] = []
        self.callback = _CB()


class LastStepProfile:
    """A TrainerCallback that runs torch.profiler over the last optimizer step (rollout and training): which
    kernels the step's device time goes to (on CPU, the CPU time of each op)."""

    def __init__(self, cuda: bool):
        from torch.profiler import ProfilerActivity, profile
        from transformers import TrainerCallback

        prof = self
        self.kernels: list = []

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if state.global_step == state.max_steps - 1:
                    prof._p = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
                    prof._p.__enter__()

            def on_step_end(self, args, state, control, **kw):
                if getattr(prof, "_p", None) is None:
                    return
                import torch

                if cuda:
                    torch.cuda.synchronize()
                prof._p.__exit__(None, None, None)
                events = prof._p.key_averages()
                rows = [(e.key, e.device_time_total if cuda else e.self_cpu_time_total) for e in events]
                rows = [(k, t) for k, t in rows if t > 0]
                total = sum(t for _, t in rows) or 1.0
                prof.kernels = [(k[:60], round(t / 1e3, 2), round(t / total, 3))
                                for k, t in sorted(rows, key=lambda r: -r[1])[:20]]  # fmt: skip
                prof._p = None

        self.callback = _CB()


def run_setup(name: str, args, dev, tmp: str) -> dict:
    import torch
    from datasets import Dataset

    from trace_hf.trainer import TraceGRPOConfig, TraceGRPOTrainer

    fp4 = name.endswith("fp4")
    model = build_model(args, fp4, dev)
    vocab = model.config.vocab_size
    tok = word_tokenizer(vocab)
    rng = random.Random(0)
    prompts = [" ".join(f"<{rng.randrange(4, vocab)}>" for _ in range(args.prompt_len)) for _ in range(256)]
    ds = Dataset.from_dict({"prompt": prompts})
    rows = args.prompts * args.num_generations

    def reward(completions, **kw):  # any spread of rewards: the benchmark times the step, not the learning
        return [float(len(c) % 7) for c in completions]

    cfg = TraceGRPOConfig(
        output_dir=os.path.join(tmp, name), max_steps=args.steps, learning_rate=1e-6, per_device_train_batch_size=8,
        gradient_accumulation_steps=rows // 8, num_generations=args.num_generations,
        max_completion_length=args.completion, temperature=1.0, logging_steps=1, report_to="none",
        bf16=dev.type == "cuda", use_cpu=dev.type != "cuda", gradient_checkpointing=dev.type == "cuda",
        save_strategy="no", seed=0, disable_tqdm=True,
        rollout_precision="fp4" if fp4 else "bf16", trace_hints=fp4, routing_replay=fp4,
        rollout_engine="generate" if name.startswith("generate") else "engine",
    )  # fmt: skip
    timer = StepTimer()
    profiler = LastStepProfile(dev.type == "cuda") if args.profile else None
    trainer = TraceGRPOTrainer(model, reward, args=cfg, train_dataset=ds, processing_class=tok,
                               callbacks=[timer.callback] + ([profiler.callback] if profiler else []))  # fmt: skip
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    world = trainer.accelerator.num_processes
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
    peaks = trainer.accelerator.gather(torch.tensor([peak], device=trainer.accelerator.device)).tolist()
    hist = [h for h in trainer.state.log_history if "trace/rollout/tokens_per_second" in h]
    later = hist[1:] or hist
    steps = timer.steps[1:] or timer.steps
    res = {
        "setup": name,
        "rollout_s": statistics.mean(h["trace/rollout/seconds"] for h in later),
        "rollout_tokens_per_s": statistics.mean(h["trace/rollout/tokens_per_second"] for h in later),
        "step_s": statistics.mean(steps),
        "step_s_all": timer.steps,
        "completion_mean_length": statistics.mean(h.get("completions/mean_length", 0) for h in later),
        "peak_gib": max(peaks) if dev.type == "cuda" else None,
        "peak_gib_per_gpu": peaks,
        "processes": world,
        "distributed": trainer.accelerator.distributed_type.value,
        "rollout_tokens_per_s_total": world * statistics.mean(h["trace/rollout/tokens_per_second"] for h in later),
        "trace_metrics": {k: v for k, v in later[-1].items() if k.startswith("trace/")},
    }
    if profiler:
        res["kernels_last_step"] = profiler.kernels  # [(kernel, ms, share of the step's device time)]
    del trainer, model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("No CUDA device: run with --smoke (interpreter) or on the GPU.", file=sys.stderr)
        return 2
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(1)
    if args.smoke:
        args.layers, args.prompts, args.num_generations, args.prompt_len, args.completion, args.steps = (
            2,
            2,
            4,
            6,
            6,
            2,
        )
    import tempfile

    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    main_process = int(os.environ.get("RANK", 0)) == 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.setups.split(","):
            t0 = time.perf_counter()
            try:
                res = run_setup(name, args, dev, tmp)
            except Exception as e:  # keep the other setups' numbers
                res = {"setup": name, "error": f"{type(e).__name__}: {e}"}
            res["wall_s"] = time.perf_counter() - t0
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if k != "trace_metrics"}), flush=True)
    base = next((r for r in results if r["setup"] == "generate_bf16" and "error" not in r), None)
    table = []
    for r in results:
        if "error" in r:
            continue
        row = {k: r[k] for k in ("setup", "rollout_tokens_per_s", "rollout_s", "step_s", "peak_gib")}
        if base:
            row["rollout_speedup"] = r["rollout_tokens_per_s"] / base["rollout_tokens_per_s"]
            row["step_speedup"] = base["step_s"] / r["step_s"]
        table.append(row)
    out = {"args": vars(args), "device": torch.cuda.get_device_name() if cuda else "cpu", "results": results,
           "table": table}  # fmt: skip
    if main_process:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    for row in table:
        print(json.dumps(row))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
