# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Sweep the launch configs of the FP4 routed-experts kernels (`trace_hf.kernels.fp4_moe_configs.CONFIG`) on the GPU.

    python -m benchmarks.kernels.fp4_moe_tune --out outputs/fp4_moe_tune.json     # H200, about 3 minutes
    python -m benchmarks.kernels.fp4_moe_tune --hopper --out outputs/hopper.json  # the Gluon kernels (`HOPPER`)

Qwen3-30B-A3B expert shapes (128 experts top-8, hidden 2048, expert width 768), packed NVFP4 weights, W4A4, for
decode batches {1, 16, 64} and a 256-token prefill chunk. Each config times the whole `experts_from_quantized`
call (align, gate/up, hidden quantization, down) replayed from a CUDA graph, on ``--copies`` copies of the weights in
turn (so that batch 1's 21 MB of experts are read from HBM, not from L2, as in a decode step), and reports the fraction of the copy
bandwidth (measured in the same run) that the bytes it must read represent: the packed weights and scales of the
distinct experts hit, the input and the output. The baseline is the fast BF16 decode path's call: BF16 input and
weights through the same kernels. Prints the best config per batch, the table `CONFIG["by_slots"]` takes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

from benchmarks.harness import copy_bandwidth, save_sweep


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--variants", default="ptx,halves", help="FP4 operand layouts to sweep")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop sweeping after this long")
    p.add_argument("--block-n", default="16,32,64", help="gate/up tile N (down: twice that)")
    p.add_argument("--block-k", default="64,128,256")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="3")
    p.add_argument("--split-k", default="1", help="gate/up split-K settings")
    p.add_argument("--block-m", default="16", help="Triton kernels: token rows per expert block (prefill wants more)")
    p.add_argument("--hopper", action="store_true", help="sweep the Gluon kernels (`HOPPER`, sm_90+) instead")
    p.add_argument("--block-t", default="8,16", help="--hopper: token rows per expert block")
    p.add_argument(
        "--x-shared", default="0,1", help="--hopper: activations decoded once into shared memory (1) or not"
    )
    p.add_argument(
        "--ring", default="0", help="--hopper: cp.async ring depth for the weights (0: registers; needs x_shared)"
    )
    p.add_argument(
        "--fused-hidden", default="0", help="--hopper, --wgmma: the hidden's quantization in the gate/up launch (1)"
    )
    p.add_argument("--wgmma", action="store_true", help="sweep the wgmma kernels (`WGMMA`, sm_90+) instead")
    p.add_argument("--wg-block-t", default="32,64", help="--wgmma: token rows per expert block")
    p.add_argument("--wg-block-n", default="64,128", help="--wgmma: weight rows per program (both GEMMs)")
    p.add_argument("--wg-warps", default="4,8", help="--wgmma: warps per program")
    p.add_argument("--wg-slice-buffers", default="0", help="--wgmma: one shared allocation per K-slice (1) or not")
    p.add_argument("--wg-gate-first", default="0", help="--wgmma: gate's MMAs waited for before up's decoding (1)")
    p.add_argument("--wg-maxnreg", default="0", help="--wgmma: register caps per thread (0: none)")
    p.add_argument("--wg-maxnreg-down", default="0", help="--wgmma: the down kernel's own caps (0: as --wg-maxnreg)")
    p.add_argument(
        "--grouped",
        action="store_true",
        help="time the grouped path (`GROUPED`: bf16 decoding + torch grouped GEMM) and the wgmma prefill entry at "
        "every batch, against transformers' BF16 grouped_mm experts as the baseline (the prefill's BF16 path)",
    )
    p.add_argument(
        "--configs",
        default="",
        help="a JSON list of whole entries to time instead of a grid (after the current one): `HOPPER` entries, or "
        '`WGMMA` ones marked {"wgmma": true, ...} (any key the tables take: maxnreg, early_weights, ...)',
    )
    p.add_argument("--decode-rows", default="16", help="--grouped: rows per program of the bf16 decoding")
    p.add_argument(
        "--grouped-fp32",
        default="",
        help="--grouped: also the grouped path with fp32 sums (`GROUPED['fp32_sums']`, Triton's grouped GEMMs) at "
        "these tiles, comma-separated block_m:block_n_gate_up:block_n_down:block_k:group_m:num_warps:num_stages",
    )
    p.add_argument(
        "--chunked-align",
        action="store_true",
        help="also the current config with `moe_align`'s chunked kernels (`fp4_moe_configs.ALIGN['chunked']`)",
    )
    p.add_argument(
        "--copies",
        type=int,
        default=8,
        help="weight copies called in turn, so that no call finds its experts in L2 (8: 168 MB at batch 1)",
    )
    return p.parse_args(argv)


#: name: the (``halves``, ``ptx``) settings
VARIANTS = {"halves": (True, False), "interleaved": (False, False), "ptx": (True, True)}


def _ints(csv: str) -> list[int]:
    return [int(v) for v in csv.split(",")]


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import triton.testing

    if not torch.cuda.is_available():
        print("fp4_moe_tune.py needs a CUDA GPU.", file=sys.stderr)
        return 2
    from trace_hf.kernels import fp4_moe as moe
    from trace_hf.kernels import fp4_moe_configs as configs
    from trace_hf.kernels import fp4_quant
    from trace_hf.rollout.engine import quantize_experts

    E, H, NI, K = 128, 2048, 768, 8
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    gu = torch.randn(E, 2 * NI, H, device=dev, generator=g).mul_(0.02).bfloat16()
    dn = torch.randn(E, H, NI, device=dev, generator=g).mul_(0.02).bfloat16()
    qgu, qdn = quantize_experts(gu, dn)
    # Copies of the weights, called in turn: the experts a small batch hits fit in the H200's 50 MB L2, and a graph
    # replaying one call would time them from L2, not from HBM as in a decode step (48 layers' worth in between).
    copies = args.copies
    bf16_w = [(gu, dn)] + [(gu.clone(), dn.clone()) for _ in range(copies - 1)]
    fp4_w = [(qgu, qdn)] + [quantize_experts(gu, dn) for _ in range(copies - 1)]
    fp4_expert_bytes = sum(t.nbytes() for t in (qgu, qdn)) / E
    bf16_expert_bytes = (gu.numel() + dn.numel()) * 2 / E

    copy_bw = copy_bandwidth(dev)

    hopper_grid = [
        {"block_t": bt, "block_n_gate_up": bn, "block_n_down": dn * bn, "block_k": bk, "num_warps": w, "split_k": sk,
         "x_shared": bool(xs), "stages": st, "fused_hidden": bool(fh)}
        for bt, bn, dn, bk, w, sk, xs, st, fh in itertools.product(*(_ints(a) for a in (
            args.block_t, args.block_n, "1,2", args.block_k, args.warps, args.split_k, args.x_shared, args.ring,
            args.fused_hidden)))
        if bn >= 16 * w and bk % 128 == 0 and (st == 0 or xs)  # the Gluon K tile: 16 code words per MMA
    ]  # fmt: skip
    wgmma_grid = [
        {
            "wgmma": True,
            "block_t": bt,
            "block_n_gate_up": bn,
            "block_n_down": bn,
            "block_k": 128,
            "num_warps": w,
            "slice_buffers": bool(sb),
            "gate_first": bool(gf),
            "maxnreg": mr,
            "maxnreg_down": md,
            "fused_hidden": bool(fh),
        }
        for bt, bn, w, sb, gf, mr, md, fh in itertools.product(
            *(_ints(a) for a in (args.wg_block_t, args.wg_block_n, args.wg_warps)),
            *(_ints(a) for a in (args.wg_slice_buffers, args.wg_gate_first, args.wg_maxnreg, args.wg_maxnreg_down)),
            _ints(args.fused_hidden),
        )
        if bn % (16 * w) == 0
    ]
    tile_keys = ("block_m", "block_n_gate_up", "block_n_down", "block_k", "group_m", "num_warps", "num_stages")
    grouped_grid = (
        [{"grouped": True, "from": 0, "block_m": 16, "decode_rows": r} for r in _ints(args.decode_rows)]
        + [dict(configs.WGMMA[-1][1], wgmma=True)]
        + [
            {"grouped": True, "from": 0, "block_m": 16, "decode_rows": 16, "fp32_sums": True,
             "fp32": dict(zip(tile_keys, (int(v) for v in t.split(":")), strict=True))}
            for t in args.grouped_fp32.split(",") if t
        ]
    )  # fmt: skip
    grid = [
        {"block_m": bm, "block_n_gate_up": bn, "block_n_down": 2 * bn, "block_k": bk, "num_warps": w,
         "num_stages": st, "halves": hv[0], "ptx": hv[1], "split_k": sk}
        for hv, bm, bn, bk, w, st, sk in itertools.product(
            [VARIANTS[v] for v in args.variants.split(",")], *(_ints(a) for a in (args.block_m, args.block_n,
                                                                                   args.block_k, args.warps,
                                                                                   args.stages, args.split_k))
        )
    ]  # fmt: skip
    by_slots, dense, hopper = list(configs.CONFIG["by_slots"]), configs.CONFIG["dense"], list(configs.HOPPER)
    chunked = configs.ALIGN["chunked"]
    wgmma, grouped = list(configs.WGMMA), dict(configs.GROUPED)
    hf_experts = _hf_experts(gu, dn, K) if args.grouped else None
    t0 = time.perf_counter()
    rows, best = [], {}
    for M in (int(b) for b in args.batches.split(",")):
        x = torch.randn(M, H, device=dev, generator=g).bfloat16()
        logits = torch.randn(M, E, device=dev, generator=g)
        tw, ids = torch.softmax(logits, -1).topk(K)
        xq = fp4_quant.quantize(x, "nvfp4", "row")
        distinct = ids.unique().numel()
        io_bytes = xq.nbytes() + M * K * H * 4

        def timed(cfg, weights, x_in):
            skip = ("grouped", "chunked_align")
            configs.GROUPED = {k: v for k, v in cfg.items() if k not in skip} if cfg.get("grouped") else {}
            configs.ALIGN["chunked"] = bool(cfg.get("chunked_align"))
            configs.WGMMA = [(0, cfg)] if cfg.get("wgmma") else []
            if "block_t" in cfg:
                configs.HOPPER = [(1 << 62, cfg)]
            else:
                configs.HOPPER = []
                configs.CONFIG["by_slots"] = [(1 << 62, cfg)]
                configs.CONFIG["dense"] = cfg
            return triton.testing.do_bench_cudagraph(
                lambda: [
                    moe.experts_from_quantized(
                        x_in, ids, tw, w_gu, w_dn, bf16_sums=bool(cfg.get("grouped")) and not cfg.get("fp32_sums")
                    )
                    for w_gu, w_dn in weights
                ],
                rep=50,
            ) / len(weights)

        # The baseline is the BF16 decode step's own call: BF16 input, BF16 weights, a BF16 hidden activation; from
        # 64 slots per expert on (prefill), the better of its 16-row blocks and 64-row ones. With --grouped, the
        # prefill's BF16 experts instead: transformers' own grouped_mm forward.
        if hf_experts is not None:
            t_bf16 = triton.testing.do_bench_cudagraph(lambda: hf_experts(x, ids, tw), rep=50) * 1e-3
        else:
            t_bf16 = timed(dense, bf16_w, x) * 1e-3
            if M * K >= 64 * E:
                t_bf16 = min(t_bf16, timed(dict(dense, block_m=64), bf16_w, x) * 1e-3)
        bf16_frac = (distinct * bf16_expert_bytes + x.nbytes + M * K * H * 4) / t_bf16 / copy_bw
        need = distinct * fp4_expert_bytes + io_bytes
        configs.CONFIG["by_slots"], configs.HOPPER, configs.WGMMA = by_slots, hopper, wgmma
        configs.GROUPED = grouped
        wg_cfg = configs.wgmma_config(M * K, E, dev)
        gr_cfg = configs.grouped_config(M * K, E, dev)
        current = (
            dict(gr_cfg, grouped=True, **{"from": 0})
            if gr_cfg
            else dict(wg_cfg, wgmma=True)
            if wg_cfg
            else dict(configs.hopper_config(M * K, dev) or configs.launch_config(M * K))
        )
        triton_cfg = dict(configs.launch_config(M * K))
        if args.configs:  # a shortlist: the current entry, then these
            sweep = [current] + [c for c in json.loads(args.configs) if c != current]
        else:
            named = (
                grouped_grid if args.grouped else wgmma_grid if args.wgmma else hopper_grid if args.hopper else grid
            )
            sweep = (
                [current]
                + ([dict(current, chunked_align=True)] if args.chunked_align else [])
                + ([triton_cfg] if current != triton_cfg else [])
                + named
            )
        for cfg in sweep:
            if time.perf_counter() - t0 > args.budget_s:
                break
            try:
                t = timed(cfg, fp4_w, xq) * 1e-3
            except Exception as e:  # a config the compiler rejects (e.g. out of shared memory)
                rows.append({"batch": M, **cfg, "error": type(e).__name__})
                continue
            r = {"batch": M, **cfg, "us": t * 1e6, "fraction": need / t / copy_bw, "vs_bf16": t_bf16 / t}
            rows.append(r)
            if M not in best or r["us"] < best[M]["us"]:
                best[M] = r
        d = next((r for r in rows if r["batch"] == M and "us" in r), None)
        b = best.get(M)
        if b:
            print(f"batch {M:4d} ({distinct} experts): current {d['us']:.1f} us ({d['fraction']:.1%} of copy), "
                  f"best {b['us']:.1f} us ({b['fraction']:.1%}, {b['vs_bf16']:.2f}x the BF16 weights' "
                  f"{t_bf16 * 1e6:.1f} us at {bf16_frac:.1%}): "
                  f"{ {k: b[k] for k in b if k not in ('batch', 'us', 'fraction', 'vs_bf16')} }", flush=True)  # fmt: skip
            t_tr = next((r["us"] for r in rows if r["batch"] == M and "us" in r and "block_t" not in r), None)
            if t_tr:
                print(f"           Triton kernels (current table) {t_tr:.1f} us: best / Triton {t_tr / b['us']:.2f}x")
    configs.CONFIG["by_slots"], configs.CONFIG["dense"], configs.HOPPER = by_slots, dense, hopper
    configs.WGMMA, configs.GROUPED = wgmma, grouped
    configs.ALIGN["chunked"] = chunked
    save_sweep(args.out, rows, best, copy_bw, time.perf_counter() - t0)
    return 0


def _hf_experts(gu, dn, top_k):
    """transformers' Qwen3-MoE experts with these BF16 weights, run by its ``grouped_mm`` implementation."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    E, two_i, H = gu.shape
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=two_i // 2, num_experts=E, num_experts_per_tok=top_k)
    config._experts_implementation = "grouped_mm"
    experts = Qwen3MoeExperts(config).to(gu.device, gu.dtype)
    experts.gate_up_proj.data.copy_(gu)
    experts.down_proj.data.copy_(dn)
    return experts


if __name__ == "__main__":
    sys.exit(main())
