# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Sweep the launch configs of the FP4-KV decode attention (`trace_hf.kernels.fp4_attention.CONFIG`) on the GPU.

    python -m benchmarks.kernels.fp4_attention_tune --out outputs/fp4_attention_tune.json     # H200, about 2 minutes

One layer of Qwen3-30B-A3B's attention (32 query / 4 KV heads of 128; ``--heads`` for another shape) decoding one token per sequence over a full
cache, for (batch, context) cells; each config times `decode_attention` (split kernel + combine) replayed from a
CUDA graph, over enough copies of the cache that they do not fit in L2 (a decode step reads each layer's cache from
HBM; batch 1 at 32K is 19 MB), and reports the fraction of the copy bandwidth (measured in the same run) that the
cache bytes represent. The BF16 cache through the same kernels (default config) is the baseline where it fits.
Prints the best config per cell (the ``fp4`` entry of ``CONFIG`` plus ``target_programs``; with ``--hopper``, the
``hopper`` entry of the Gluon kernel against the Triton kernel's current config). Each config runs under
`benchmarks.harness.override`, so the committed ``CONFIG`` is back after the sweep.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time

from benchmarks import harness


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cells", default="64x32768,16x32768,1x32768", help="BATCHxCONTEXT, comma separated")
    p.add_argument("--budget-s", type=float, default=150.0, help="stop sweeping after this long")
    p.add_argument("--block-t", default="64,128")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="2,3,4",
                   help="num_stages of the Triton kernel; with --hopper the cp.async ring depth (0: loads to registers)")  # fmt: skip
    p.add_argument("--programs", default="264,528,1056", help="target_programs settings (split-K)")
    p.add_argument("--prefetch", default="0,1", help="--hopper: software pipelining off/on")
    p.add_argument("--maxnreg", default="0,128", help="--hopper: register caps (0: none)")
    p.add_argument("--min-chunk", default="64,256", help="--hopper: smallest split, in tokens")
    p.add_argument("--min-copy-mb", type=float, default=256.0,
                   help="cache copies called in turn add up to at least this (past the 50 MB L2)")  # fmt: skip
    p.add_argument(
        "--heads",
        default="32,4,128",
        help="query heads, KV heads, head size (Qwen3-30B-A3B; Qwen3.5-35B-A3B: 16,2,256)",
    )
    p.add_argument("--hopper", action="store_true",
                   help="sweep the Gluon kernel's CONFIG['hopper'] (block_t x programs) instead, against the Triton "
                        "kernel's current config in the same run")  # fmt: skip
    return p.parse_args(argv)


def _csv(s: str) -> list[int]:
    return [int(v) for v in s.split(",")]


def main(argv=None) -> int:
    args = parse_args(argv)
    env = harness.setup_device("fp4_attention_tune.py", gpu_only=True)
    if env is None:
        return 2
    import torch
    import triton.testing

    from trace_hf.kernels import fp4_attention as A

    HQ, HKV, D = _csv(args.heads)
    dev = env.device
    copy_bw = harness.copy_bandwidth(dev)
    if args.hopper:
        if not A.uses_hopper_kernel(True, D, dev):
            print("--hopper needs an sm_90+ GPU and a Triton with Gluon.", file=sys.stderr)
            return 2
        default = {"kernel": "triton", **A.CONFIG["fp4"], "target_programs": A.CONFIG["target_programs"]}
        # prefetch (into registers) applies to stages 0 only
        grid = [{"kernel": "hopper", "block_t": bt, "stages": st, "prefetch": bool(pf), "maxnreg": mr or None,
                 "target_programs": tp, "min_chunk": mc, "max_splits": A.CONFIG["hopper"]["max_splits"]}
                for bt, st, pf, mr, tp, mc in itertools.product(*(_csv(a) for a in (
                    args.block_t, args.stages, args.prefetch, args.maxnreg, args.programs, args.min_chunk)))
                if not (st and pf)]  # fmt: skip
    else:
        default = {"kernel": "triton", **A.CONFIG["fp4"], "target_programs": A.CONFIG["target_programs"]}
        grid = [
            {"kernel": "triton", "block_t": bt, "num_warps": w, "num_stages": st, "target_programs": tp}
            for bt, w, st, tp in itertools.product(
                *(_csv(a) for a in (args.block_t, args.warps, args.stages, args.programs))
            )
        ]
    t0 = time.perf_counter()
    rows, best = [], {}
    for spec in args.cells.split(","):
        B, T = (int(v) for v in spec.split("x"))
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(B, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
        lengths = torch.full((B,), T, dtype=torch.int32, device=dev)
        out = torch.empty_like(q)

        def bench(caches) -> float:
            """ms per call (triton's unit), the calls going through ``caches`` in turn."""
            return triton.testing.do_bench_cudagraph(
                lambda: [A.decode_attention(q, c, lengths, out=out) for c in caches], rep=50
            ) / len(caches)

        def allocate(fp4: bool) -> list:
            n = max(1, math.ceil(args.min_copy_mb * 1e6 / (A.kv_bytes_per_token(HKV, D, fp4) * B * T)))
            caches = [A.allocate_kv_cache(B, HKV, T, D, fp4, device=dev) for _ in range(n)]
            for c in caches:
                A.fill_random(c, g)
            return caches

        def timed(cache, cfg):
            launch = {k: v for k, v in cfg.items() if k not in ("kernel", "target_programs")}
            if cfg["kernel"] == "hopper":  # min_chunk in launch
                settings = {"hopper": {**launch, "target_programs": cfg["target_programs"]}}
            else:
                settings = {"hopper": {}, "fp4": launch, "target_programs": cfg["target_programs"]}
            with harness.override({"fp4_attention.CONFIG": settings}):
                return bench(cache)

        t_bf16 = None
        bf16_bytes = A.kv_bytes_per_token(HKV, D, False) * B * T
        if max(bf16_bytes, args.min_copy_mb * 1e6) * 1.2 < torch.cuda.mem_get_info()[0]:
            cache = allocate(False)
            t_bf16 = bench(cache) * 1e-3  # a BF16 cache: the Triton kernel whatever CONFIG["hopper"] says
            del cache
        cache = allocate(True)
        need = cache[0].nbytes()
        for cfg in [default] + grid:
            if time.perf_counter() - t0 > args.budget_s:
                break
            try:
                t = timed(cache, cfg) * 1e-3
            except Exception as e:  # a config the compiler rejects (e.g. out of shared memory)
                rows.append({"cell": spec, **cfg, "error": type(e).__name__})
                continue
            r = {"cell": spec, **cfg, "us": t * 1e6, "fraction": need / t / copy_bw}
            if t_bf16:
                r["vs_bf16"] = t_bf16 / t
            rows.append(r)
            if spec not in best or r["us"] < best[spec]["us"]:
                best[spec] = r
        del cache
        d = next((r for r in rows if r["cell"] == spec and "us" in r), None)
        b = best.get(spec)
        if b:
            base = f"BF16 cache {t_bf16 * 1e6:.1f} us at {bf16_bytes / t_bf16 / copy_bw:.1%}" if t_bf16 else "no BF16"
            print(f"{spec}: current {d['us']:.1f} us ({d['fraction']:.1%} of copy), best {b['us']:.1f} us "
                  f"({b['fraction']:.1%}; {base}): { {k: v for k, v in b.items() if k not in ('cell', 'us')} }",
                  flush=True)  # fmt: skip
    harness.save_sweep(args.out, rows, best, copy_bw, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
