# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The recurrent gated delta rule's backward kernel (`gated_delta_recurrent.RecurrentRule`) against transformers'
torch chunked rule under autograd, at Qwen3.5's head shape, by the kernel's settings (GPU).

    python -m benchmarks.kernels.gated_delta_backward --out gdr_bwd.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1152)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("times CUDA kernels: run it on a machine with an NVIDIA GPU (the tests check the kernel on the CPU)")
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as M

    from trace_hf.kernels import gated_delta_recurrent as R
    from trace_hf.train.delta_rule import torch_rules

    chunk_rule, _ = torch_rules(M)
    B, T, hk, hv, d = args.rows, args.tokens, 16, 32, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, T, hk, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, hv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    glog = -torch.rand(B, T, hv, device="cuda", generator=g) * 3
    beta = torch.rand(B, T, hv, device="cuda", generator=g).bfloat16()
    grad = torch.randn(B, T, hv, d, device="cuda", generator=g, dtype=torch.bfloat16)

    def timed(fn, n=3):
        fn()
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for _ in range(n):
            fn()
        ev[1].record()
        torch.cuda.synchronize()
        return ev[0].elapsed_time(ev[1]) / n

    def fwd_bwd(rule, **kw):
        def run():
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v, glog, beta)]
            out, _ = rule(*leaves, use_qk_l2norm_in_kernel=True, **kw)
            out.backward(grad)

        return run

    res = {"rows": B, "tokens": T, "chunk_torch_ms": timed(fwd_bwd(chunk_rule, chunk_size=64))}
    print("torch chunked rule, forward + backward ms", res["chunk_torch_ms"], flush=True)
    cells = []
    for chunk, bv, warps in itertools.product((8, 16, 32), (8, 16, 32), (1, 2, 4)):
        R.BACKWARD.update(chunk=chunk, block_v=bv, num_warps=warps)
        try:
            ms = timed(fwd_bwd(R.recurrent_gated_delta_rule), n=2)
        except Exception as e:  # noqa: BLE001 - a setting that does not compile is a result too
            ms = repr(e)[:120]
        cells.append({"chunk": chunk, "block_v": bv, "num_warps": warps, "ms": ms})
        print(cells[-1], flush=True)
    res["kernel"] = cells
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
