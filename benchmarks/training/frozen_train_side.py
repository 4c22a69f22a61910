# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Where the training side of frozen-expert GRPO spends its time, outside the trainer: the Qwen3-30B-A3B shape
(``--layers`` of 48; the same per-layer work) with PEFT LoRA r=32 on q/k/v/o, one micro-batch of GRPO (8 rows x
128 prompt + 512 completion tokens, some rows left-padded), the contexts `TraceGRPOTrainer` puts around its
forwards (`use_hints` with routing replay for FP4, `aligned_positions` for BF16), gradient checkpointing on.

    python -m benchmarks.training.frozen_train_side --out frozen_train_side.json     # H200, ~1 min
    python -m benchmarks.training.frozen_train_side --smoke --out /tmp/fts.json       # CPU, tiny

Setups: ``bf16`` (frozen BF16 experts), ``fp4`` (frozen packed NVFP4 experts on the rollout's kernels, FP4 KV fake
quantization, hints on the default half of the layers), ``fp4_torch`` (the same on the torch experts path),
``fp4_nohints`` (``fp4`` without `use_hints`: no hints, no replay). Per setup: the no-grad forward (train mode, as
TRL's old log-probs) and forward + backward (seconds, CUDA-synchronized medians), and for the no-grad forward the
device time the profiler sees (kernels summed) against the wall time, with the top kernels and CPU ops.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from types import SimpleNamespace

from benchmarks import harness


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--completion", type=int, default=512)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--setups", default="bf16,fp4,fp4_torch,fp4_nohints")
    return p.parse_args(argv)


def lora_model(layers: int, fp4: bool, dev, smoke: bool = False):
    """The Qwen3-30B-A3B-shaped model of `grpo_step` (``smoke``: tiny) with frozen experts (packed FP4 or BF16), PEFT
    LoRA r=32 on q/k/v/o and non-reentrant gradient checkpointing, as the one-GPU LoRA job trains it."""
    from peft import LoraConfig, get_peft_model

    from benchmarks.training.grpo_step import build_model

    model = build_model(SimpleNamespace(smoke=smoke, layers=layers, freeze_experts=True), fp4, dev)
    lora = LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(model, lora)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def record_hints(model, ids, mask, kernel: str):
    """The hints of one eval forward of ``ids`` with the FP4 experts' eval path on ``kernel``, as a rollout records
    them; the model is left in train mode."""
    import torch

    from trace_hf import HintRecorder
    from trace_hf.quant.experts import fp4_experts

    for m in fp4_experts(model):
        m.kernel = kernel
    model.eval()
    with torch.no_grad(), HintRecorder(model) as rec:
        model(input_ids=ids, attention_mask=mask)
    model.train()
    return rec.collect(mask)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trace_hf import use_hints
    from trace_hf.hints import aligned_positions

    cuda = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.layers, args.rows, args.prompt, args.completion, args.iters = 2, 2, 6, 6, 1
    dev = torch.device("cuda" if cuda else "cpu")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn) -> float:
        return statistics.median(harness.call_times(fn, args.iters, cuda=cuda, wall=True))

    results, built = {}, {}
    for setup in args.setups.split(","):
        fp4 = setup.startswith("fp4")
        if fp4 not in built:
            for m in built.values():
                del m
            built.clear()
            model = lora_model(args.layers, fp4, dev, args.smoke)
            built[fp4] = model
        model = built[fp4]
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(0)
        n = args.prompt + args.completion
        ids = torch.randint(4, vocab, (args.rows, n), generator=g).to(dev)
        mask = torch.ones_like(ids)
        for r in range(0, args.rows, 2):
            mask[r, : args.prompt // (r + 2)] = 0  # left padding
        hints = record_hints(model, ids, mask, "torch" if setup == "fp4_torch" else "auto") if fp4 else None
        model.train()

        def ctx():
            if hints is None or setup == "fp4_nohints":
                return aligned_positions(model, mask)
            return use_hints(model, hints, mask, routing_replay=True, apply_hints=True)

        def no_grad():
            with torch.no_grad(), contextlib.ExitStack() as s:
                s.enter_context(ctx())
                return model(input_ids=ids, attention_mask=mask, logits_to_keep=args.completion + 1).logits

        def fwd_bwd():
            with ctx():
                logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=args.completion + 1).logits
                logits.float().logsumexp(-1).mean().backward()
            model.zero_grad(set_to_none=True)

        res = {"no_grad_forward_s": timed(no_grad), "forward_backward_s": timed(fwd_bwd)}
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        sync()
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            no_grad()
            sync()
        res["profiled_no_grad_wall_s"] = time.perf_counter() - t0
        ev = prof.key_averages()
        kernels = sorted(((e.key, e.self_device_time_total / 1e3) for e in ev if e.self_device_time_total > 0),
                         key=lambda r: -r[1])  # fmt: skip
        res["no_grad_device_ms"] = sum(ms for _, ms in kernels)
        res["no_grad_top_kernels_ms"] = [(k[:80], round(ms, 2)) for k, ms in kernels[:12]]
        cpu = sorted(((e.key, e.self_cpu_time_total / 1e3, e.count) for e in ev), key=lambda r: -r[1])
        res["no_grad_top_cpu_ops_ms_calls"] = [(k[:80], round(ms, 2), c) for k, ms, c in cpu[:15]]
        results[setup] = res
        print(setup, {k: round(v, 4) for k, v in res.items() if isinstance(v, float)}, flush=True)
    shape = {k: getattr(args, k) for k in ("layers", "rows", "prompt", "completion")}
    with open(args.out, "w") as f:
        json.dump({"shape": shape, "torch": torch.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
