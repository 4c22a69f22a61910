# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""One MoE layer's routed experts on the training side, at a GRPO micro-batch's shape (8 rows x 1,152 tokens,
top-8 of 128 experts, hidden 2048, width 768: Qwen3-30B-A3B), per phase: the no-grad log-prob forward, the
training forward (autograd graph built) and forward + backward (what checkpointing's recompute + backward costs
the layer). Setups: frozen BF16 experts (grouped GEMMs, no quantization), frozen packed NVFP4 experts on the torch
path (`experts_kernel="torch"`: dequantize + grouped GEMMs) and on the rollout's fused kernels
(`experts_kernel="triton"`), each FP4 one also with experts_input hints on every token.

    python -m benchmarks.training.frozen_experts_layer --out frozen_experts_layer.json [--profile]   # H200, ~1 min
    python -m benchmarks.training.frozen_experts_layer --smoke --out /tmp/fel.json                     # CPU, tiny

Milliseconds are medians over ``--iters`` CUDA-event-timed repeats; ``--profile`` adds each setup's top kernels of
one forward + backward (torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from benchmarks import harness


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton interpreter)")
    p.add_argument("--tokens", type=int, default=9216)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--expert-dim", type=int, default=768)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--setups", default="bf16,fp4_torch,fp4_kernel,fp4_torch_hints,fp4_kernel_hints")
    return p.parse_args(argv)


def build(setup: str, gu, d):
    from torch import nn

    from trace_hf.quant.experts import TraceFP4Experts

    if setup == "bf16":  # qat=False in train mode: the plain grouped GEMMs on the (frozen) dense weights
        return TraceFP4Experts(nn.Parameter(gu, requires_grad=False), nn.Parameter(d, requires_grad=False),
                               nn.functional.silu, "nvfp4", "fp4", qat=False).train()  # fmt: skip
    kernel = "triton" if "kernel" in setup else "torch"
    return TraceFP4Experts(gu, d, nn.functional.silu, "nvfp4", "fp4", kernel=kernel, cache_qat_weights=False,
                           frozen=True).train()  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("frozen_experts_layer.py needs CUDA (or --smoke)", file=sys.stderr)
        return 2
    if args.smoke:
        args.tokens, args.hidden, args.experts, args.top_k, args.expert_dim, args.iters = 24, 64, 4, 2, 32, 1
    from trace_hf import fp4
    from trace_hf.hints.replay import Guide
    from trace_hf.hints.report import MismatchReport
    from trace_hf.quant.sites import HintSite

    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    T, H, E, K, NI = args.tokens, args.hidden, args.experts, args.top_k, args.expert_dim
    g = torch.Generator(device=dev).manual_seed(0)
    gu = torch.randn(E, 2 * NI, H, device=dev, generator=g, dtype=dtype) * 0.02
    d = torch.randn(E, H, NI, device=dev, generator=g, dtype=dtype) * 0.02
    x = torch.randn(T, H, device=dev, generator=g, dtype=dtype)
    logits = torch.randn(T, E, device=dev, generator=g)
    w, ids = torch.softmax(logits, -1).topk(K)
    w = (w / w.sum(-1, keepdim=True)).to(dtype)
    dy = torch.randn(T, H, device=dev, generator=g, dtype=dtype)
    hints = fp4.extract_hints(fp4.quantize(x, "nvfp4", "row"))
    hints.mantissa_bits[::2] ^= 0x11  # some hints disagree with nearest rounding, as the rollout's do

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn) -> float:
        return 1e3 * statistics.median(harness.call_times(fn, args.iters, cuda=cuda))

    results, outs = {}, {}
    for setup in args.setups.split(","):
        mod = build(setup, gu, d)
        if setup.endswith("_hints"):
            guide = Guide(
                "experts_input", hints, torch.ones(T, dtype=torch.bool, device=dev), T, 0, MismatchReport(), True
            )
            mod.sites["experts_input"] = HintSite("experts_input", 0, guide=guide)
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

        def no_grad():
            with torch.no_grad():
                return mod(x, ids, w)

        def train_forward():
            return mod(xi, ids, wi)

        def forward_backward():
            xi.grad = wi.grad = None
            y = mod(xi, ids, wi)
            y.backward(dy)
            return y

        res = {"no_grad_forward_ms": timed(no_grad), "train_forward_ms": timed(train_forward),
               "forward_backward_ms": timed(forward_backward)}  # fmt: skip
        res["backward_with_recompute_ms"] = res["forward_backward_ms"]  # checkpointing recomputes the forward
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            forward_backward()
            sync()
            res["fwd_bwd_peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        y = forward_backward()
        outs[setup] = (y.detach().float(), xi.grad.float(), wi.grad.float())
        if args.profile and cuda:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                forward_backward()
                sync()
            rows = [(e.key, e.device_time_total / 1e3) for e in prof.key_averages()]
            rows.sort(key=lambda r: -r[1])
            total = sum(r[1] for r in rows)
            res["kernels_fwd_bwd"] = [(k[:90], round(ms, 3)) for k, ms in rows[:14]]
            res["kernels_total_ms"] = total
        results[setup] = res
        print(setup, {k: round(v, 3) for k, v in res.items() if isinstance(v, float)}, flush=True)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    agreement = {}
    for fast, slow in (("fp4_kernel", "fp4_torch"), ("fp4_kernel_hints", "fp4_torch_hints")):
        if fast in outs and slow in outs:
            agreement[f"{fast}_vs_{slow}"] = dict(zip(("output", "grad_input", "grad_routing_weights"),
                                                      map(rel, outs[fast], outs[slow])))  # fmt: skip
    print(json.dumps(agreement, indent=1))
    shape = {"tokens": T, "hidden": H, "experts": E, "top_k": K, "expert_dim": NI, "dtype": str(dtype)}
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu"}
    with open(args.out, "w") as f:
        json.dump({"shape": shape, "env": env, "results": results, "relative_difference": agreement}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
