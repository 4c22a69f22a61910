# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""One decode-step call inside a CUDA profiler range, for Nsight Compute: the routed experts
(`fp4_moe.experts_from_quantized`, FP4 path or the BF16 decode path) or the decode attention
(`fp4_attention.decode_attention`, FP4 or BF16 KV cache), Qwen3-30B-A3B shapes, after a warm-up.

    ncu --clock-control none --profile-from-start off --set full -o fp4_b64 \\
        python -m benchmarks.kernels.ncu_call experts --path fp4 --batch 64
    ncu --clock-control none --profile-from-start off --set full -o attn_b64 \\
        python -m benchmarks.kernels.ncu_call attention --path fp4 --batch 64 --context 1024
    python -m benchmarks.kernels.ncu_summary fp4_b64.raw.csv   # after ncu --import fp4_b64.ncu-rep --page raw --csv

ncu flushes the caches between its replay passes, so weights and cache are read from HBM as in a decode step.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import harness


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("op", choices=("experts", "attention"))
    p.add_argument("--path", choices=("fp4", "bf16"), required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--context", type=int, default=1024, help="attention: cached tokens per sequence")
    args = p.parse_args(argv)
    env = harness.setup_device("ncu_call.py", gpu_only=True)
    if env is None:
        return 2
    import torch

    dev = env.device
    g = torch.Generator(device=dev).manual_seed(0)
    if args.op == "experts":
        from trace_hf.kernels import fp4_moe as moe
        from trace_hf.kernels import fp4_moe_configs as configs
        from trace_hf.kernels import fp4_quant
        from trace_hf.rollout.engine import quantize_experts

        E, H, NI, K = 128, 2048, 768, 8
        w_gu = torch.randn(E, 2 * NI, H, device=dev, generator=g).mul_(0.02).bfloat16()
        w_dn = torch.randn(E, H, NI, device=dev, generator=g).mul_(0.02).bfloat16()
        x = torch.randn(args.batch, H, device=dev, generator=g).bfloat16()
        tw, ids = torch.softmax(torch.randn(args.batch, E, device=dev, generator=g), -1).topk(K)
        if args.path == "fp4":
            w_gu, w_dn = quantize_experts(w_gu, w_dn)
            x = fp4_quant.quantize(x, "nvfp4", "row")
            print("HOPPER entry:", configs.hopper_config(args.batch * K, dev), flush=True)

        def call():
            moe.experts_from_quantized(x, ids, tw, w_gu, w_dn)
    else:
        from trace_hf.kernels import fp4_attention as A

        HQ, HKV, D = 32, 4, 128
        q = torch.randn(args.batch, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
        lengths = torch.full((args.batch,), args.context, dtype=torch.int32, device=dev)
        out = torch.empty_like(q)
        cache = A.allocate_kv_cache(args.batch, HKV, args.context, D, args.path == "fp4", device=dev)
        A.fill_random(cache, g)

        def call():
            A.decode_attention(q, cache, lengths, out=out)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
