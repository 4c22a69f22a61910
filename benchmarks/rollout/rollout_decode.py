# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Rollout decode speed at Qwen3-30B-A3B's shapes (random weights): stock transformers BF16 `generate`, the
static-shape fast path with BF16 weights and BF16 KV, and the fast path with FP4 experts (W4A4), FP4 KV cache
and hints recorded.

    python -m benchmarks.rollout.rollout_decode --out outputs/rollout_decode.json       # H200, about 5-6 minutes
    python -m benchmarks.rollout.rollout_decode --smoke --out /tmp/rollout_smoke.json   # CPU, interpreter, tiny model

Setups, per cell (batch B x context T):
  1. ``hf``: `Qwen3MoeForCausalLM.generate` (BF16, default experts implementation, DynamicCache). The cache is
     prefilled with random K/V (no real prefill: a decode step costs the same whatever the values); the step
     time is (generate of 2 + N tokens - generate of 2 tokens) / N.
  2. ``fast_bf16``: `trace_hf.rollout.engine.FastDecoder` with the same BF16 weights and a BF16 KV cache, one CUDA
     graph per step.
  3. ``fast_fp4``: the same decoder with NVFP4 experts (W4A4), an NVFP4 KV cache and hints recorded; the same
     step without hints is timed too (hint overhead).
Each cell reports tokens/s (B / step time), the bytes the step must read (non-expert weights, the experts the
batch is expected to touch, lm_head, KV cache) and that over the step time as a fraction of the measured
device-to-device copy bandwidth. Cells that do not fit in memory, or that the time budget leaves out, say so.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="path of the JSON with the numbers")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU through TRITON_INTERPRET=1")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--contexts", default="1024,8192,32768")
    p.add_argument("--setups", default="hf,fast_bf16,fast_fp4")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--steps", type=int, default=20, help="timed graph replays per cell")
    p.add_argument("--hf-new-tokens", type=int, default=8)
    p.add_argument("--hf-max-context", type=int, default=8192, help="skip setup 1 above this context (time)")
    p.add_argument("--budget-s", type=float, default=330.0, help="stop starting cells after this many seconds")
    p.add_argument("--profile", action="store_true", help="also record the GPU time of each kernel of a fast step")
    p.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch (to compare)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from benchmarks import harness

    env = harness.setup_device("rollout_decode.py", args.smoke)  # before triton is imported
    if env is None:
        return 2
    cuda = env.cuda
    import triton

    from benchmarks.rollout.decode_setup import bytes_per_step, fill_random_context, kv_bytes_read, random_weights
    from trace_hf.kernels import pdl
    from trace_hf.rollout.engine import Dims, FastDecoder, weights_from_hf

    pdl.ENABLED = not args.no_pdl

    t_start = time.perf_counter()
    dev, dtype = env.device, env.dtype
    if args.smoke:
        dims = Dims(64, 4, 2, 32, 8, 2, 32, 128, 2)
        batches, contexts, steps = [1, 2], [24], 1
    else:
        dims = Dims.qwen3_30b_a3b(args.layers)
        batches = [int(b) for b in args.batches.split(",")]
        contexts = [int(c) for c in args.contexts.split(",")]
        steps = args.steps
    setups = args.setups.split(",")
    pad = 2 * steps + 16  # cache room for the warm-up, capture and timed steps
    res: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
        "smoke": args.smoke,
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "dims": vars(dims),
        "dtype": str(dtype),
        "cells": [],
        "notes": [],
    }
    try:
        import transformers

        res["versions"]["transformers"] = transformers.__version__
    except Exception:  # pragma: no cover
        pass

    def note(msg: str) -> None:
        print(msg, flush=True)
        res["notes"].append(msg)

    def over_budget() -> bool:
        return time.perf_counter() - t_start > args.budget_s

    def free_bytes() -> int:
        if not cuda:
            return 1 << 62
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    copy_bw = harness.copy_bandwidth(dev) if cuda else float("nan")
    res["copy_bytes_per_s"] = copy_bw
    print(f"device {res['device']}, copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)

    def cell(setup, B, T, **kw):
        c = {"setup": setup, "batch": B, "context": T, **kw}
        res["cells"].append(c)
        msg = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in c.items())
        print(msg, flush=True)
        return c

    def time_steps(run, n) -> float:
        return harness.time_per_call(run, n, warmup=3 if cuda else 0)

    kv_tok_bf16 = 2 * dims.num_kv_heads * dims.head_dim * (2 if cuda else 4) * dims.num_layers
    kv_tok_fp4 = 2 * dims.num_kv_heads * (dims.head_dim // 2 + dims.head_dim // 16 + 4) * dims.num_layers

    # ---- setup 1: transformers generate ---------------------------------------------------------------------
    model = None
    dense = None
    if "hf" in setups:
        try:
            model = _build_hf_model(dims, dtype, dev)
            dense = weights_from_hf(model)
            for T in contexts:
                for B in batches:
                    if not args.smoke and args.hf_max_context < T:
                        cell("hf", B, T, status=f"skipped: context above --hf-max-context {args.hf_max_context} "
                             "(stock generate is slow there; time budget)")  # fmt: skip
                        continue
                    if over_budget():
                        cell("hf", B, T, status="skipped: time budget")
                        continue
                    need = kv_tok_bf16 * B * (T + 64) * (1 + 2 / dims.num_layers) + (4 << 30)
                    if need > free_bytes():
                        cell("hf", B, T, status=f"does not fit ({need / 2**30:.0f} GiB needed for the BF16 cache)")
                        continue
                    try:
                        n_new = 2 if args.smoke else args.hf_new_tokens
                        step = _hf_step_time(model, dims, B, T, n_new, dtype, dev, sync)
                        by = bytes_per_step(dense, B, kv_tok_bf16 * B * T)
                        cell("hf", B, T, status="ok", step_ms=step * 1e3, tokens_per_s=B / step,
                             bytes_per_step=by["total"], frac_copy_bw=by["total"] / step / copy_bw)  # fmt: skip
                    except Exception as e:  # keep going: one failed cell must not lose the others
                        cell("hf", B, T, status=f"error: {type(e).__name__}: {e}"[:500])
                        traceback.print_exc()
        except Exception as e:
            note(f"setup hf failed: {type(e).__name__}: {e}")
            traceback.print_exc()

    # ---- weights for the fast path (shared with the HF model when it exists) ----------------------------------
    if dense is None:
        dense = random_weights(dims, dtype, dev, fp4_experts=False)

    def fast_cells(setup: str, weights, kv_fp4: bool, hints: bool):
        for T in contexts:
            for B in batches:
                if over_budget():
                    cell(setup, B, T, status="skipped: time budget")
                    continue
                kv_need = (kv_tok_fp4 if kv_fp4 else kv_tok_bf16) * B * (T + pad)
                if kv_need + (3 << 30) > free_bytes():
                    cell(setup, B, T, status=f"does not fit ({kv_need / 2**30:.0f} GiB KV cache)")
                    continue
                dec = None
                try:
                    dec = FastDecoder(weights, B, T + pad, kv_fp4=kv_fp4, record_hints=hints)
                    fill_random_context(dec, T)
                    out = {}
                    variants = [("hints", True), ("no_hints", False)] if hints else [("main", False)]
                    graphs = {}
                    for name, rec in variants:
                        dec.record_hints = rec and dec.fp4_experts
                        if cuda:
                            dec.capture()
                            graphs[name] = dec.graph
                        else:
                            graphs[name] = None
                    times = {name: [] for name, _ in variants}
                    rounds = 2 if hints and cuda else 1
                    for _ in range(rounds):  # interleaved, so that drift hits both variants alike
                        for name, rec in variants:
                            dec.record_hints = rec and dec.fp4_experts
                            g = graphs[name]
                            dec.positions.fill_(T)
                            times[name].append(time_steps(g.replay if g is not None else dec.step, steps))
                    step = min(times[variants[0][0]])
                    by = bytes_per_step(weights, B, kv_bytes_read(dec, T))
                    out.update(status="ok", step_ms=step * 1e3, tokens_per_s=B / step, bytes_per_step=by["total"],
                               frac_copy_bw=by["total"] / step / copy_bw, bytes=by)  # fmt: skip
                    if hints:
                        t_no = min(times["no_hints"])
                        out.update(step_ms_no_hints=t_no * 1e3, hint_overhead=step / t_no - 1.0)
                    if args.profile and cuda:
                        g = graphs[variants[0][0]]
                        dec.record_hints = variants[0][1] and dec.fp4_experts
                        dec.positions.fill_(T)
                        out["kernels"] = harness.kernel_times(g.replay)["top"]
                    cell(setup, B, T, **out)
                except Exception as e:
                    cell(setup, B, T, status=f"error: {type(e).__name__}: {e}"[:500])
                    traceback.print_exc()
                finally:
                    dec = None
                    graphs = None

    if "fast_bf16" in setups:
        fast_cells("fast_bf16", dense, kv_fp4=False, hints=False)

    if "fast_fp4" in setups:
        try:
            fp4w = random_weights(dims, dtype, dev, fp4_experts=True, shared=dense)
            # The BF16 experts are no longer needed: free them (the HF model held the same tensors).
            model = None
            dense = None
            free_bytes()
            fast_cells("fast_fp4", fp4w, kv_fp4=True, hints=True)
        except Exception as e:
            note(f"setup fast_fp4 failed: {type(e).__name__}: {e}")
            traceback.print_exc()

    # ---- ratios and table ---------------------------------------------------------------------------------
    by_key = {(c["setup"], c["batch"], c["context"]): c for c in res["cells"] if c.get("status") == "ok"}
    rows = []
    for T in contexts:
        for B in batches:
            c3 = by_key.get(("fast_fp4", B, T))
            row = {"batch": B, "context": T}
            for s in ("hf", "fast_bf16", "fast_fp4"):
                c = by_key.get((s, B, T))
                row[s] = c["tokens_per_s"] if c else None
            if c3:
                for s, key in (("hf", "fp4_over_hf"), ("fast_bf16", "fp4_over_bf16")):
                    c = by_key.get((s, B, T))
                    row[key] = c3["tokens_per_s"] / c["tokens_per_s"] if c else None
                row["hint_overhead"] = c3.get("hint_overhead")
            rows.append(row)
    res["table"] = rows
    res["seconds"] = time.perf_counter() - t_start
    harness.write_json(args.out, res)

    print(f"\n{'B':>4} {'T':>6} {'hf tok/s':>9} {'bf16 tok/s':>10} {'fp4 tok/s':>10} {'fp4/hf':>7} {'fp4/bf16':>8} "
          f"{'hints':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['batch']:>4} {r['context']:>6} {harness.fmt(r['hf']):>9} {harness.fmt(r['fast_bf16']):>10} {harness.fmt(r['fast_fp4']):>10} "
              f"{harness.fmt(r.get('fp4_over_hf'), '.2f'):>7} {harness.fmt(r.get('fp4_over_bf16'), '.2f'):>8} "
              f"{harness.fmt(r.get('hint_overhead'), '+.1%'):>7}")  # fmt: skip
    print(f"total {res['seconds']:.0f} s; JSON: {args.out}")
    return 0


def _build_hf_model(dims, dtype, dev):
    """`Qwen3MoeForCausalLM` from a config on the meta device, materialized on ``dev`` with random weights."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        hidden_size=dims.hidden, num_hidden_layers=dims.num_layers, num_attention_heads=dims.num_heads,
        num_key_value_heads=dims.num_kv_heads, head_dim=dims.head_dim, num_experts=dims.num_experts,
        num_experts_per_tok=dims.top_k, moe_intermediate_size=dims.expert_dim, vocab_size=dims.vocab,
        intermediate_size=6144, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        rms_norm_eps=dims.eps, rope_theta=dims.rope_theta, max_position_embeddings=40960,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    model = model.to(dtype=dtype)
    model.to_empty(device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    rot = type(model.model.rotary_emb)(config=config)
    model.model.rotary_emb = rot.to(dev)
    if dev.type == "cuda" and hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation("grouped_mm")
        except Exception as e:  # an older transformers: keep its default
            print(f"set_experts_implementation('grouped_mm') failed ({e}); using the default", flush=True)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def _hf_step_time(model, dims, B, T, n_new, dtype, dev, sync) -> float:
    """Seconds per decode step of `generate` over a DynamicCache prefilled with T random tokens."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    shape = (B, dims.num_kv_heads, T, dims.head_dim)
    for layer in range(dims.num_layers):
        cache.update(torch.randn(shape, dtype=dtype, device=dev), torch.randn(shape, dtype=dtype, device=dev), layer)
    ids = torch.randint(3, dims.vocab, (B, T + 1), device=dev)
    mask = torch.ones_like(ids)

    def gen(n):
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n,
                           min_new_tokens=n, do_sample=False)  # fmt: skip
        extra = cache.get_seq_length() - T
        if extra > 0:
            cache.crop(-extra)  # a negative count removes tokens, in every transformers 5.x

    gen(2)  # warm-up
    sync()
    t0 = time.perf_counter()
    gen(2)
    sync()
    t1 = time.perf_counter()
    gen(2 + n_new)
    sync()
    t2 = time.perf_counter()
    return max((t2 - t1) - (t1 - t0), 1e-9) / n_new


if __name__ == "__main__":
    sys.exit(main())
