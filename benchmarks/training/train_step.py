# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Cost of the QAT training step: forward + backward of a `TraceFP4Config` model in train mode with hints and
routing replay (`use_hints`), against the plain BF16 model (same weights, same batch, no quantization); with the
fake-quantized expert weights cached per optimizer step (the default) and without (`cache_qat_weights=False`).

    python -m benchmarks.training.train_step --out outputs/train_step.json              # H200, under 1.5 minutes
    python -m benchmarks.training.train_step --smoke --out /tmp/train_step_smoke.json   # CPU, tiny model

The hints are recorded the way a rollout would: an eval forward of the same batch under `HintRecorder`. All three
models run the training side's fused RMSNorm and rotary kernels, as `TraceGRPOTrainer` does by default
(`--no-fused`: transformers' ops). Reported: median seconds per step of each, their ratio (goal: QAT <= 1.2x BF16)
and the peak memory of each.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import statistics
import sys
import time

from benchmarks import harness


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--expert-dim", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    harness.add_kernel_flags(p, adapter_casts=False)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    env = harness.setup_device("train_step.py", args.smoke)
    if env is None:
        return 2
    cuda = env.cuda
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from trace_hf import TraceFP4Config
    from trace_hf.hints import HintRecorder, use_hints
    from trace_hf.quant.experts import fp4_experts
    from trace_hf.quant.quantizer import quantize_model
    from trace_hf.train.rms_norm import fuse_rms_norms
    from trace_hf.train.rope import fused_rope

    dev = env.device
    if args.smoke:
        args.layers, args.hidden, args.experts, args.top_k, args.expert_dim = 2, 64, 8, 2, 32
        args.vocab, args.batch, args.seq, args.steps = 128, 2, 16, 1
    dtype = env.dtype
    heads = max(1, args.hidden // 128)
    config = Qwen3MoeConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4), head_dim=128 if cuda else 32, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_dim, intermediate_size=4 * args.hidden,
        vocab_size=args.vocab, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        max_position_embeddings=max(4096, args.seq), tie_word_embeddings=False, output_router_logits=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(dev):
        base = AutoModelForCausalLM.from_config(config, dtype=dtype)
    qat = quantize_model(copy.deepcopy(base), TraceFP4Config())
    lean = quantize_model(copy.deepcopy(base), TraceFP4Config(cache_qat_weights=False))
    fused = contextlib.nullcontext
    if not args.no_fused:  # as TraceGRPOTrainer: norms swapped once, the rotary embedding rebound per forward
        for m in (base, qat, lean):
            fuse_rms_norms(m)
        fused = functools.partial(fused_rope, base)
    base.train()
    ids = torch.randint(3, args.vocab, (args.batch, args.seq), device=dev)
    mask = torch.ones_like(ids)

    qat.eval()
    with torch.no_grad(), HintRecorder(qat) as rec:
        qat(input_ids=ids, attention_mask=mask, use_cache=False)
    hints = rec.collect(mask)
    qat.train()

    def step_base():
        with fused():
            loss = base(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
            loss.backward()
        base.zero_grad(set_to_none=True)

    def step_of(model):
        def step():
            with fused(), use_hints(model, hints, mask):
                loss = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
                loss.backward()
            model.zero_grad(set_to_none=True)

        return step

    step_qat, step_lean = step_of(qat), step_of(lean)

    def timed(fn) -> float:
        """Median seconds of ``args.steps`` steps, each timed on its own, after a warm-up step."""
        return statistics.median_high(harness.call_times(fn, args.steps))

    t0 = time.perf_counter()
    res = {"device": env.name if cuda else "cpu", "smoke": args.smoke, "config": vars(args)}
    # Alternate, so that drift affects both alike.
    t_base = timed(step_base)
    t_qat = timed(step_qat)
    t_lean = timed(step_lean)
    t_base = min(t_base, timed(step_base))
    res.update(bf16_step_s=t_base, qat_step_s=t_qat, ratio=t_qat / t_base, qat_uncached_step_s=t_lean,
               ratio_uncached=t_lean / t_base, tokens=args.batch * args.seq)  # fmt: skip
    # What the cache holds: the dequantized expert weights, one extra copy in the model dtype.
    res["weight_cache_gib"] = (
        sum(t.nbytes for m in fp4_experts(qat) for t in m.weight_store.dequantized.weights) / 2**30
    )
    if cuda:
        res["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    res["seconds"] = time.perf_counter() - t0
    harness.write_json(args.out, res)
    print(f"BF16 step {t_base * 1e3:.1f} ms, QAT (FP4 + hints + routing replay) step {t_qat * 1e3:.1f} ms, "
          f"ratio {t_qat / t_base:.2f}x (goal <= 1.2x); without the weight cache {t_lean * 1e3:.1f} ms, "
          f"{t_lean / t_base:.2f}x (saves {res['weight_cache_gib']:.2f} GiB); JSON: {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
