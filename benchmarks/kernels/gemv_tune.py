# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Sweep the launch config of `trace_hf.kernels.decode_ops.gemv` (batch 1's projections) on the GPU.

    python -m benchmarks.kernels.gemv_tune --out outputs/gemv_tune.json
    python -m benchmarks.kernels.gemv_tune --out g.json --then benchmarks.rollout.rollout_decode --out d.json --batches 1

Times one decode layer's three one-row products of Qwen3-30B-A3B (QKV 2048 -> 5120, o_proj 4096 -> 2048, router
2048 -> 128, bf16) for each config, from CUDA graphs, against ``F.linear`` (cuBLAS), and reports the best by their
sum. Each graph calls ``--copies`` copies of the weights in turn: one layer's 38 MB fit in the H200's 50 MB L2, and
a graph replaying one call would time them from L2, not from HBM as in a decode step (48 layers in between). With
``--then`` it runs the given benchmark (a module name or a script path) in this process with that config set (so a
benchmark measures it); otherwise the committed ``GEMV`` is back at the end.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from benchmarks import harness


KEYS = ("block_n", "block_k", "num_warps", "num_stages", "early_tiles", "x_bcast")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--block-n", default="4,8,16")
    p.add_argument("--block-k", default="512,1024")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="3,4")
    p.add_argument(
        "--early-tiles", default="0", help="GEMV early_tiles: K tiles of weights loaded before the PDL wait"
    )
    p.add_argument("--x-bcast", default="0", help="GEMV x_bcast (0, 1): x read in the weights' layout")
    p.add_argument("--copies", type=int, default=8, help="weight copies called in turn (8: 300 MB, past the L2)")
    p.add_argument(
        "--then", nargs=argparse.REMAINDER, help="a benchmark and its arguments to run with the best config"
    )
    args = p.parse_args(argv)
    if args.copies < 1:
        p.error(f"--copies {args.copies}: use 1 or more (8 puts a layer's weights past the L2).")
    env = harness.setup_device("gemv_tune.py", gpu_only=True)
    if env is None:
        return 2
    import torch
    import triton.testing

    from trace_hf.kernels import decode_ops

    dev = env.device
    shapes = {"qkv": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048)}
    mats = {k: (torch.randn(1, K, device=dev, dtype=torch.bfloat16),
                [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(args.copies)])
            for k, (N, K) in shapes.items()}  # fmt: skip

    def times(fn) -> dict:
        """us per call of each product, the weights read from HBM."""
        return {
            k: triton.testing.do_bench_cudagraph(lambda x=x, ws=ws: [fn(x, w) for w in ws], rep=30) * 1e3 / len(ws)
            for k, (x, ws) in mats.items()
        }

    cublas = times(torch.nn.functional.linear)
    rows = []
    ints = [
        [int(v) for v in a.split(",")]
        for a in (args.block_n, args.block_k, args.warps, args.stages, args.early_tiles, args.x_bcast)
    ]
    for bn, bk, w, st, early, xb in itertools.product(*ints):
        cfg = {
            "block_n": bn,
            "block_k": bk,
            "num_warps": w,
            "num_stages": st,
            "early_tiles": early,
            "x_bcast": bool(xb),
        }
        with harness.override({"decode_ops.GEMV": cfg}):
            t = times(decode_ops.gemv)
        rows.append({**cfg, "us": t, "sum_us": sum(t.values())})
    best = min(rows, key=lambda r: r["sum_us"])
    layer_bytes = sum(ws[0].nbytes for _, ws in mats.values())
    summary = {"cublas_us": cublas, "cublas_sum_us": sum(cublas.values()), "best": best, "rows": rows,
               "copies": args.copies, "best_tb_per_s": layer_bytes / best["sum_us"] * 1e-6}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"cuBLAS {summary['cublas_sum_us']:.1f} us per layer { ({k: round(v, 1) for k, v in cublas.items()}) }")
    print(f"best gemv {best['sum_us']:.1f} us ({summary['best_tb_per_s']:.2f} TB/s) "
          f"{({k: round(v, 1) for k, v in best['us'].items()})}: "
          f"{ {k: best[k] for k in KEYS} }")  # fmt: skip
    if args.then:
        with harness.override({"decode_ops.GEMV": {k: best[k] for k in KEYS}}):
            harness.run_target(args.then[0], args.then[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
