# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Sweep of `trace_hf.kernels.gated_delta.CONFIG` (value columns per program, warps): one Gated DeltaNet layer's
rule and gated norm (`gated_delta_step`) at Qwen3.5-35B-A3B's shape (16 key / 32 value heads of 128), per batch.

    python -m benchmarks.kernels.gated_delta_tune --out outputs/gated_delta_tune.json   # H200, well under a minute

The fp32 state is what the step reads and writes ([B, 32, 128, 128]: 2 MB a row), so each config reports the state
bytes (read + written) per second as a fraction of the copy bandwidth measured in the same run; the state copies
called in turn add up to past the 50 MB L2, as a decode step's 30 layers do. Each config runs under
`benchmarks.harness.override`, so the committed CONFIG is back after the sweep.
"""

from __future__ import annotations

import argparse
import itertools
import sys

from benchmarks import harness


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="64,256,384")
    p.add_argument("--block-v", default="16,32,64,128")
    p.add_argument("--warps", default="2,4,8,16")
    args = p.parse_args(argv)
    env = harness.setup_device("gated_delta_tune.py", gpu_only=True)
    if env is None:
        return 2
    import torch

    from trace_hf.kernels import gated_delta

    dev, dt = env.device, torch.bfloat16
    hk, dk, hv, dv = 16, 128, 32, 128
    C = 2 * hk * dk + hv * dv
    copy_bw = harness.copy_bandwidth(dev)
    res = {"copy_bw": copy_bw, "default": dict(gated_delta.CONFIG), "cells": []}
    for B in (int(x) for x in args.batches.split(",")):
        state_bytes = B * hv * dk * dv * 4
        copies = max(1, -(-(256 << 20) // state_bytes))
        states = [torch.randn(B, hv, dk, dv, device=dev) * 0.05 for _ in range(copies)]
        qkv = torch.randn(B, C, device=dev) * 0.1
        proj = torch.randn(B, C + hv * dv + 2 * hv, device=dev).to(dt)
        a_log, dt_bias, nw = (
            torch.zeros(hv, device=dev),
            torch.ones(hv, device=dev, dtype=dt),
            torch.ones(dv, device=dev, dtype=dt),
        )
        turn = itertools.cycle(states)

        def step():
            gated_delta.gated_delta_step(next(turn), qkv, proj, a_log, dt_bias, nw, 1e-6, hk)

        for bv, nw_ in itertools.product(*(map(int, a.split(",")) for a in (args.block_v, args.warps))):
            if bv > dv:
                continue
            with harness.override({"gated_delta.CONFIG": {"block_v": bv, "num_warps": nw_}}):
                try:
                    s = harness.time_per_call(step, 50, warmup=5)
                except Exception as e:  # a config that does not compile (registers): keep the others
                    res["cells"].append({"batch": B, "block_v": bv, "num_warps": nw_, "error": str(e)[:200]})
                    continue
            cell = {"batch": B, "block_v": bv, "num_warps": nw_, "us": s * 1e6,
                    "frac_copy_bw": 2 * state_bytes / s / copy_bw}  # fmt: skip
            res["cells"].append(cell)
            print(harness.fmt(cell["us"]), cell, flush=True)
        del states
    best = {}
    for c in res["cells"]:
        if "us" in c and (c["batch"] not in best or c["us"] < best[c["batch"]]["us"]):
            best[c["batch"]] = c
    res["best"] = best
    print("best:", best)
    harness.write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
