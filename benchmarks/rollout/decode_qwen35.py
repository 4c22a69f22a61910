# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Decode-step time of the rollout engine's `HybridDecoder` on a random Qwen3.5-35B-A3B shape, FP4 against BF16.

    python -m benchmarks.rollout.decode_qwen35 --out outputs/decode_qwen35.json              # H200: 40 layers
    python -m benchmarks.rollout.decode_qwen35 --smoke --out /tmp/decode_qwen35_smoke.json   # CPU, interpreter

The shape: hidden 2048, 40 layers (Gated DeltaNet 3 of every 4, gated full attention every 4th: 16 query / 2 KV
heads of 256), 256 experts of width 512 top-8 plus a 512-wide shared expert, vocabulary 151,936. Random weights
built as tensors (no transformers model); every sequence holds ``context`` tokens of random K/V and random
linear-attention states. ``bf16``: dense experts, BF16 KV cache; ``fp4``: NVFP4 W4A4 experts (the BF16 ones
quantized in place, so one copy is alive), FP4 KV cache, hints recorded at the last half of the layers;
``fp4_triton`` / ``bf16_triton``: the same with the delta rule in `trace_hf.kernels.gated_delta`
(``delta_rule="triton"``). Each cell captures the step in a CUDA graph and times ``--steps`` replays (CUDA events).
A cell that does not fit records its error and the others go on, so a list of batches at one context finds each
setup's best batch that fits (``best``: per context and setup, the batch with the most tokens/s, and FP4's best over
BF16's with the same delta rule):

    python -m benchmarks.rollout.decode_qwen35 --cells 64x1024,64x32768,128x32768,256x32768,384x32768 --out ...

``--admit`` adds, per setup and context, the cell the rollout engine itself would run: the rows it admits for one
wave decoding to that context (`runner.bytes_per_row` under `planner.memory_budget` with EngineRollout's default
``free_memory_fraction``, measured when the cell starts), with the step records an FP4 rollout keeps for every
decoded token held beside it (``records_gib``). Against the best batch of the listed cells, it says whether
admission leaves throughput behind and whether what it admits fits. ``--hint-storage cpu`` admits as the engine
does when the trainer keeps hints in CPU memory (``trace_hint_storage="cpu"``): the records stream off the device
every ``record_window`` steps, so a row holds a window of them (EngineRollout's default window).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

import torch

from benchmarks import harness


SETUPS = ("bf16", "bf16_triton", "fp4", "fp4_triton")


def dims(layers: int, smoke: bool):
    from trace_hf.rollout.engine.qwen35 import HybridDims

    types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers))
    if smoke:
        return HybridDims(64, 4, 2, 32, 8, 2, 32, 300, layers, layer_types=types, rotary_dim=8, lin_k_heads=2,
                          lin_v_heads=4, lin_k_dim=16, lin_v_dim=16, conv_kernel=4, shared_dim=32)  # fmt: skip
    return HybridDims(2048, 16, 2, 256, 256, 8, 512, 151936, layers, layer_types=types, rotary_dim=64,
                      lin_k_heads=16, lin_v_heads=32, lin_k_dim=128, lin_v_dim=128, conv_kernel=4,
                      shared_dim=512)  # fmt: skip


def random_weights(d, dtype, device, seed=0):
    from trace_hf.rollout.engine.qwen35 import HybridDecodeWeights, HybridLayerWeights, pad_rows

    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

    def ones(n, dt=torch.float32):
        return torch.ones(n, dtype=dt, device=device)

    H, D, E, NI = d.hidden, d.head_dim, d.num_experts, d.expert_dim
    layers = []
    for i, kind in enumerate(d.layer_types):
        common = {"ln_post": ones(H), "w_router": rnd(E, H), "gate_up": rnd(E, 2 * NI, H), "down": rnd(E, H, NI),
                  "w_shared": pad_rows(rnd(2 * d.shared_dim + 1, H)), "w_shared_down": rnd(H, d.shared_dim),
                  "hinted": i >= d.num_layers // 2}  # fmt: skip
        if kind == "full_attention":
            lw = HybridLayerWeights(kind, ones(H), rnd((2 * d.num_heads + 2 * d.num_kv_heads) * D, H),
                                    rnd(H, d.num_heads * D), q_norm=ones(D), k_norm=ones(D), **common)  # fmt: skip
        else:
            vd = d.lin_v_heads * d.lin_v_dim
            lw = HybridLayerWeights(kind, ones(H), rnd(d.conv_dim + vd + 2 * d.lin_v_heads, H), rnd(H, vd),
                                    conv=rnd(d.conv_dim, d.conv_kernel) * 10, a_log=torch.zeros(d.lin_v_heads, device=device),
                                    dt_bias=ones(d.lin_v_heads, dtype), gate_norm=ones(d.lin_v_dim, dtype), **common)  # fmt: skip
        layers.append(lw)
    return HybridDecodeWeights(d, rnd(d.vocab, H), ones(H), rnd(d.vocab, H), layers)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--cells", default="64x1024,64x32768", help="batch x context, comma-separated")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--profile",
        action="store_true",
        help="also record where each cell's GPU time goes: by kernel, and the launches per step",
    )
    p.add_argument("--admit", action="store_true",
                   help="also run, per setup and context, the rows the rollout engine admits (its step records held)")  # fmt: skip
    p.add_argument("--hint-storage", choices=["device", "cpu"], default="device",
                   help="--admit: where the rollout keeps hints; 'cpu' streams the step records, a window of them held")  # fmt: skip
    p.add_argument("--setups", default="bf16,fp4,fp4_triton",
                   help=f"comma-separated, of {','.join(SETUPS)} (run in that order: fp4 quantizes in place)")  # fmt: skip
    p.add_argument("--expandable-segments", action="store_true",
                   help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before CUDA starts): the in-place "
                        "quantization's freed BF16 experts leave no fragments the caches cannot use")  # fmt: skip
    args = p.parse_args(argv)
    if args.expandable_segments:  # added to the user's allocator settings, if any
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, (conf, "expandable_segments:True")))
    setups = [x for x in SETUPS if x in args.setups.split(",")]
    unknown = set(args.setups.split(",")) - set(SETUPS)
    if unknown:
        p.error(f"unknown setups {sorted(unknown)}: use {','.join(SETUPS)}")
    env = harness.setup_device("decode_qwen35.py", args.smoke)
    if env is None:
        return 2
    cuda = env.cuda
    if args.smoke:
        args.layers, args.cells, args.steps = 4, "2x16", 2
    from trace_hf.rollout.engine import quantize_experts
    from trace_hf.rollout.engine.qwen35 import HybridDecoder

    dev, dtype = env.device, env.dtype
    d = dims(args.layers, args.smoke)
    w = random_weights(d, dtype, dev)
    cells = [tuple(int(x) for x in c.split("x")) for c in args.cells.split(",")]
    res = {"args": vars(args), "device": env.name if cuda else "cpu", "cells": []}
    quantized = False
    for setup in setups:
        fp4 = setup.startswith("fp4")
        if fp4 and not quantized:
            quantized = True
            for lw in w.layers:  # in place: the BF16 experts are freed as each layer is quantized
                lw.gate_up, lw.down = quantize_experts(lw.gate_up, lw.down)
                if cuda:
                    torch.cuda.empty_cache()
        runs = [(B, T, False) for B, T in cells]
        if args.admit:
            runs += [(None, T, True) for T in dict.fromkeys(T for _, T in cells)]
        for B, T, admit in runs:
            t0 = time.perf_counter()
            records = None
            fragments = None
            if cuda:  # each cell's own peak, not the run's; the allocator's unusable fragments as it starts
                torch.cuda.reset_peak_memory_stats()
                fragments = torch.cuda.memory_stats().get("inactive_split_bytes.all.current", 0) / 2**30
            try:
                if admit:  # after the cells before it are freed, as the engine plans a wave
                    B, nbytes = admitted_rows(w, T + args.steps + 8, T, fp4, dev, args.hint_storage)
                    if B == 0:
                        raise torch.OutOfMemoryError("the engine admits no row at this context")
                    records = torch.empty(B * nbytes, dtype=torch.uint8, device=dev)
                dec = HybridDecoder(w, B, T + args.steps + 8, kv_fp4=fp4, record_hints=fp4,
                                    delta_rule="triton" if setup.endswith("triton") else "torch")  # fmt: skip
                g = torch.Generator(device=dev).manual_seed(0)
                for c in dec.caches:
                    if c is not None:
                        _fill(c, g)
                for s in dec.recurrent_states:
                    if s is not None:
                        s.normal_(0, 0.05, generator=g)
                dec.positions.fill_(T)
                dec.tokens.random_(0, d.vocab, generator=g)
                if cuda:
                    dec.capture()
                step_s = harness.time_per_call(dec.run, args.steps, warmup=1 if cuda else 0)
                assert torch.isfinite(dec.logits).all(), "non-finite logits"
                cell = {"setup": setup, "batch": B, "context": T, "step_ms": step_s * 1e3, "tokens_per_s": B / step_s,
                        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                        "reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
                        "fragments_gib": fragments}  # fmt: skip
                if admit:
                    cell |= {"admitted": True, "records_gib": records.numel() / 2**30}
                if args.profile and cuda:
                    dec.positions.fill_(T)
                    cell["kernels"] = harness.kernel_times(dec.run, top=25)
                del dec
            except Exception as e:  # keep the other cells
                cell = {"setup": setup, "batch": B, "context": T, "error": f"{type(e).__name__}: {e}"[:300],
                        "fragments_gib": fragments}  # fmt: skip
                if admit:
                    cell["admitted"] = True
            records = None
            cell["wall_s"] = time.perf_counter() - t0
            res["cells"].append(cell)
            print(json.dumps(cell), flush=True)
            if cuda:
                torch.cuda.empty_cache()
    by = {(c["setup"], c["batch"], c["context"]): c for c in res["cells"] if "error" not in c}
    res["fp4_over_bf16"] = {f"{B}x{T}": by[("fp4", B, T)]["tokens_per_s"] / by[("bf16", B, T)]["tokens_per_s"]
                            for B, T in cells if ("fp4", B, T) in by and ("bf16", B, T) in by}  # fmt: skip
    res["fp4_triton_over_bf16_triton"] = {
        f"{B}x{T}": by[("fp4_triton", B, T)]["tokens_per_s"] / by[("bf16_triton", B, T)]["tokens_per_s"]
        for B, T in cells
        if ("fp4_triton", B, T) in by and ("bf16_triton", B, T) in by
    }
    res["triton_rule_over_torch_rule"] = {
        f"{B}x{T}": by[("fp4_triton", B, T)]["tokens_per_s"] / by[("fp4", B, T)]["tokens_per_s"]
        for B, T in cells
        if ("fp4_triton", B, T) in by and ("fp4", B, T) in by
    }
    res["best"] = best_batches(res["cells"])
    print(json.dumps(res["fp4_over_bf16"]), json.dumps(res["triton_rule_over_torch_rule"]), json.dumps(res["best"]))
    harness.write_json(args.out, res)
    return 0


def admitted_rows(w, length: int, context: int, fp4: bool, dev, storage: str = "device") -> tuple[int, int]:
    """The rows the rollout engine admits for one wave of ``length``-token cache rows decoding ``context`` tokens
    (the bucket `planner.plan_waves` picks under EngineRollout's default budget; FP4 records hints), and the step
    records' bytes per row that the engine holds on the device: all of them until the wave ends, or with
    ``storage="cpu"`` its default ``record_window`` steps of them."""
    from trace_hf.rollout.engine import EngineRollout
    from trace_hf.rollout.engine.planner import memory_budget
    from trace_hf.rollout.engine.runner import bytes_per_row, largest_bucket
    from trace_hf.rollout.sampling import SamplingSettings

    defaults = inspect.signature(EngineRollout).parameters
    fraction = defaults["free_memory_fraction"].default
    window = defaults["record_window"].default if storage == "cpu" else None
    s = SamplingSettings(max_new_tokens=context)
    per_row = bytes_per_row(w, length, 1, s, kv_fp4=fp4, record=fp4, record_window=window)
    without = bytes_per_row(w, length, 1, s, kv_fp4=fp4, record=False)
    budget = memory_budget(dev, None, fraction, 0)
    rows = largest_bucket(budget // per_row.decode) if budget is not None else 1
    return rows, per_row.decode - without.decode


def best_batches(cells: list[dict]) -> dict:
    """Per context: each setup's fastest cell that ran (``batch``, ``tokens_per_s``), and FP4's best over BF16's
    with the same delta rule; with ``--admit``, each setup's admitted cell (``admitted``: its batch and tokens/s, or
    its error) beside it."""
    out = {}
    for c in cells:
        if c.get("admitted"):
            ctx = out.setdefault(str(c["context"]), {})
            ctx[f"{c['setup']}_admitted"] = {k: c[k] for k in ("batch", "tokens_per_s", "error") if k in c}
            continue
        if "error" in c:
            continue
        ctx = out.setdefault(str(c["context"]), {})
        if c["setup"] not in ctx or c["tokens_per_s"] > ctx[c["setup"]]["tokens_per_s"]:
            ctx[c["setup"]] = {"batch": c["batch"], "tokens_per_s": c["tokens_per_s"]}
    for ctx in out.values():
        for fp4, bf16 in (("fp4", "bf16"), ("fp4_triton", "bf16_triton")):
            if fp4 in ctx and bf16 in ctx:
                ctx[f"{fp4}_over_{bf16}"] = ctx[fp4]["tokens_per_s"] / ctx[bf16]["tokens_per_s"]
    return out


def _fill(cache, g):
    from trace_hf.rollout.engine.kernels import kernels

    kernels().attention.fill_random(cache, g)


if __name__ == "__main__":
    sys.exit(main())
