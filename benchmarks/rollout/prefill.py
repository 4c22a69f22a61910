# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The rollout engine's prefill at the Qwen3-30B-A3B shape (random weights), FP4 against BF16, per cell of rows x
prompt tokens; with ``--profile``, where each prefill's device time goes.

    python -m benchmarks.rollout.prefill --setups fp4,bf16 --cells 1x16384,16x1024,256x128 --profile \
        --out prefill.json                                                # H200, 48 layers, about 2 minutes
    python -m benchmarks.rollout.prefill --smoke --profile --out /tmp/prefill.json   # CPU, tiny model, interpreter

Setups (`benchmarks.training.grpo_step.build_model` with frozen experts, its ``--freeze-experts``; the same random
draws in all): ``fp4`` packed NVFP4 experts (`TraceFP4Config(freeze_experts=True)`), TRACE hints recorded, FP4 KV
cache; ``fp4_bf16_gemms`` the same with `TraceFP4Config(prefill_bf16_gemms=True)` (the experts as bf16 grouped
GEMMs); ``fp4_chunked_align`` the default ``fp4`` with ``fp4_moe_configs.ALIGN["chunked"]`` on (`moe_align`'s layout
from chunked Triton kernels, no radix sort; the same bits); ``bf16`` BF16 experts,
BF16 KV cache. They run one after the other, each model built once and freed before
the next (48 layers: about 17 GB FP4, 57 GB BF16).

What is timed is the engine's own prefill, `EngineRollout._prefill` (what `EngineRollout._wave` calls): one forward
of the transformers model in eval mode over the prompts, ``logits_to_keep=1``, under `no_prefill_refresh()`, into
`fp4_cache(config, "nvfp4")` under a `HintRecorder` (``fp4``) or into a `DynamicCache` (``bf16``). Then, timed on
its own, `EngineRollout._load_cache`: that cache copied into the static cache of the model's decoder (`FastDecoder`,
the prompt's length rounded up to 256 tokens). Not timed: the weight refresh before a rollout (frozen experts have
nothing to re-quantize), building the decoder, the first token's draw. Prompts are random ids, every row full length:
no left padding, which the timing does not need (the same GEMMs, the same tokens), except that with a padded row
the attention gets an explicit mask, where all-full rows let transformers pass none (SDPA's causal path).

Per cell: the median of ``--repeats`` prefills after one warm-up (the first FP4 cell's warm-up also compiles the
Triton kernels), in ms, prompt tokens/s, the load-cache ms and the peak memory; per rows x tokens, ``fp4_over_bf16``
(FP4's prompt tokens/s over BF16's: above 1, FP4 is faster) of the forward and of forward + load. A cell that does
not fit records its error (OOM) and the others go on. ``--budget-s``: setup k of n starts no cell once the run is
past (k + 1) / n of the budget (its build counted), so both setups get their share; a skipped cell says so.

``--profile``: torch.profiler over one more prefill per cell. Its device time (in ``--smoke`` the CPU time of the
ops) is split into the parts of `part_of` (the `SCOPES` the kernels were launched in, then the name patterns of
`PARTS`), with the top 15 kernels and the part each went to, and (GPU) ``gpu_idle_ms``: the timed forward's
median less the profiled kernels' time, what the GPU spends waiting on the host (launches, synchronizations).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import re
import statistics
import sys
import time
import traceback
from types import SimpleNamespace


#: Profile parts: a kernel (in ``--smoke``: an op) launched inside one of these `record_function` scopes, the
#: innermost counting, goes to the scope's part; `scoped` opens them around the routed experts' forward (their
#: GEMMs, sort/align, activation, weighted sum), each KV cache layer's ``update`` (FP4: quantize, concatenate,
#: dequantize for attention; BF16: concatenate) and the `HintRecorder`'s record methods (hint bits, routing ids).
SCOPES = {"routed_experts": "routed_experts", "kv_cache_write": "fp4_quant_kv_write", "hints": "hint_recording"}
SCOPE_PREFIX = "prefill/"

#: Then, in order, the first pattern a kernel's name matches (case-insensitive). FP4 quantization kernels
#: (`trace_hf.kernels.fp4_quant`: the experts' input, K/V) always count as "fp4_quant_kv_write", whatever scope
#: launched them; the expert kernels' names are matched too, in case a profiler does not link a Triton launch to
#: its scope.
PARTS = [
    ("fp4_quant_kv_write", r"_fp4_kernel|_row_amax_kernel|_dequant_kernel|quantize"),
    ("routed_experts", r"gate_up_kernel|down_kernel|silu_mul|_align_kernel|_chunk_|GroupProblemShape|grouped"),
    ("attention", r"sdpa|flash|fmha|attention|attn"),
    ("bf16_gemm", r"nvjet|gemm|xmma|cutlass|cublas|^aten::(mm|addmm|bmm|matmul|linear)$"),
    ("norms_elementwise", r"elementwise|reduce|norm|softmax|topk|sort|gather|scatter|index|cat|copy|memcpy|memset"
                          r"|fill"),
]  # fmt: skip
_PARTS = [(name, re.compile(p, re.IGNORECASE)) for name, p in PARTS]
PART_NAMES = ["routed_experts", "attention", "fp4_quant_kv_write", "hint_recording", "norms_elementwise", "bf16_gemm",
              "other"]  # fmt: skip


def part_of(name: str, scope: str | None) -> str:
    """The profile part of a kernel (or op) ``name`` launched inside ``scope`` (a key of `SCOPES`, or None)."""
    if scope == "hints":
        return SCOPES[scope]
    if _PARTS[0][1].search(name):
        return _PARTS[0][0]
    if scope is not None:
        return SCOPES[scope]
    return next((part for part, pat in _PARTS if pat.search(name)), "other")


SETUPS = ("fp4", "fp4_bf16_gemms", "fp4_chunked_align", "bf16")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="path of the JSON with the numbers")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU through TRITON_INTERPRET=1")
    p.add_argument("--setups", default="fp4,bf16", help="comma-separated, of fp4 and bf16")
    p.add_argument("--cells", default="1x16384,16x1024,256x128", help="rows x prompt tokens, comma-separated")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3, help="timed prefills per cell (median), after one warm-up")
    p.add_argument("--budget-s", type=float, default=120.0,
                   help="start no cell past this many seconds (setup k of n: past (k + 1) / n of it)")  # fmt: skip
    p.add_argument("--profile", action="store_true", help="profile one more prefill per cell, by part and kernel")
    p.add_argument(
        "--sync-check",
        action="store_true",
        help="one more prefill per cell (CUDA) under torch.cuda.set_sync_debug_mode('warn'): the host syncs by call "
        "site, and the allocator's device allocations, frees and retries (cudaFree and retries sync the device)",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.cells, args.layers, args.repeats = "1x16,2x8", 2, 1
    setups = args.setups.split(",")
    bad = [s for s in setups if s not in SETUPS] + (["(none)"] if not args.setups else [])
    if bad or len(set(setups)) != len(setups):
        p.error(f"--setups {args.setups!r}: name each of {', '.join(SETUPS)} at most once, e.g. --setups fp4,bf16.")
    args.setups = setups
    try:
        args.cells = [tuple(int(v) for v in c.lower().split("x")) for c in args.cells.split(",")]
        if any(len(c) != 2 or min(c) < 1 for c in args.cells):
            raise ValueError
    except ValueError:
        p.error(f"--cells {args.cells!r}: give rows x prompt tokens, comma-separated, e.g. --cells 1x16384,256x128.")
    if args.repeats < 1 or args.layers < 1:
        p.error("--repeats and --layers must be at least 1.")
    return args


@contextlib.contextmanager
def scoped(lm):
    """Inside, the `SCOPES` are open (`torch.profiler.record_function`, named ``prefill/<scope>``) around the routed
    experts' forward of ``lm``, the cache layers' ``update`` and the `HintRecorder`'s record methods, so that a
    profile can tell which kernels each launched. Patched on the classes and restored after the block."""
    from torch.profiler import record_function
    from transformers.cache_utils import DynamicLayer

    from trace_hf.hints import HintRecorder
    from trace_hf.quant.kv_cache import FP4KVLayer

    experts = {type(layer.mlp.experts) for layer in lm.model.layers}
    targets = [(cls, "forward", "routed_experts") for cls in experts]
    targets += [(DynamicLayer, "update", "kv_cache_write"), (FP4KVLayer, "update", "kv_cache_write")]
    targets += [(HintRecorder, m, "hints") for m in ("_on_forward", "record_input", "record_hidden", "record_kv",
                                                     "record_routing")]  # fmt: skip

    def wrap(fn, scope):
        @functools.wraps(fn)
        def inner(*a, **k):
            with record_function(SCOPE_PREFIX + scope):
                return fn(*a, **k)

        return inner

    saved = []
    try:
        for cls, attr, scope in targets:
            saved.append((cls, attr, cls.__dict__.get(attr)))
            setattr(cls, attr, wrap(getattr(cls, attr), scope))
        yield
    finally:
        for cls, attr, own in reversed(saved):
            if own is None:
                delattr(cls, attr)
            else:
                setattr(cls, attr, own)


def event_times(events, cuda: bool):
    """Microseconds per (kernel name, part) of a profile's events (`FunctionEvent`s). GPU: every kernel's duration,
    in the part of the innermost scope of the CPU op it is linked to, else by its name alone; CPU: every op's own
    time, in its scope's part."""
    from collections import Counter

    from torch.autograd import DeviceType

    def scope_of(e):
        while e is not None:
            if e.name.startswith(SCOPE_PREFIX):
                return e.name[len(SCOPE_PREFIX) :]
            e = e.cpu_parent
        return None

    ours = lambda name: name.startswith(SCOPE_PREFIX) or name.startswith("ProfilerStep")  # noqa: E731
    us: Counter = Counter()
    if not cuda:
        for e in events:
            if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0:
                us[(e.name, part_of(e.name, scope_of(e)))] += e.self_cpu_time_total
        return us
    total: Counter = Counter()
    for e in events:
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False) and not ours(e.name):
            total[e.name] += e.time_range.elapsed_us()
    linked: Counter = Counter()
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue
        for k in e.kernels:
            if k.name != e.name and not ours(k.name):
                us[(k.name, part_of(k.name, scope_of(e)))] += k.duration
                linked[k.name] += k.duration
    for name, t in total.items():
        if t - linked[name] > 0:
            us[(name, part_of(name, None))] += t - linked[name]
    return us


def sync_check(run) -> dict:
    """One call of ``run`` under ``torch.cuda.set_sync_debug_mode("warn")``: the synchronizing calls by Python call
    site (file:line, count), and the caching allocator's device allocations, frees and retries in the call."""
    import warnings

    import torch

    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries")
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    sites: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            site = f"{w.filename}:{w.lineno}"
            sites[site] = sites.get(site, 0) + 1
    return {"syncs": sum(sites.values()), "sync_sites": sites, **{k: after.get(k, 0) - before.get(k, 0) for k in keys}}


def profile_parts(run, cuda: bool, top: int = 15) -> dict:
    """One call of ``run`` under torch.profiler, inside `scoped` ranges: its device time (CPU: ops' own CPU time) per
    part (`part_of`) in ms and as a share, and the ``top`` kernels (name, ms, part). A kernel the profiler did not
    link to the op that launched it counts by its name alone (`event_times`)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        run()
        if cuda:
            import torch

            torch.cuda.synchronize()
    us = event_times(prof.events(), cuda)
    parts = dict.fromkeys(PART_NAMES, 0.0)
    for (_, part), t in us.items():
        parts[part] += t
    whole = sum(parts.values()) or 1.0
    kernels = sorted(us.items(), key=lambda kv: -kv[1])[:top]
    return {
        "total_ms": round(whole / 1e3, 3),
        "unit": "device time" if cuda else "CPU time of the ops (--smoke)",
        "parts_ms": {p: round(t / 1e3, 3) for p, t in parts.items()},
        "parts_share": {p: round(t / whole, 4) for p, t in parts.items()},
        "top_kernels": [[name[:120], round(t / 1e3, 3), part] for (name, part), t in kernels],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    from benchmarks import harness

    env = harness.setup_device("prefill.py", args.smoke)  # before triton is imported
    if env is None:
        return 2
    import torch
    import transformers
    import triton

    from benchmarks.training.grpo_step import build_model
    from trace_hf.kernels import fp4_moe_configs
    from trace_hf.quant.experts import fp4_experts
    from trace_hf.rollout.base import left_pad
    from trace_hf.rollout.engine import EngineRollout, kv_format, weights_from_hf
    from trace_hf.rollout.engine.layouts import layout_of

    cuda, dev = env.cuda, env.device
    t_start = time.perf_counter()
    res: dict = {
        "device": env.name, "smoke": args.smoke, "layers": args.layers, "repeats": args.repeats,
        "versions": {"torch": torch.__version__, "triton": triton.__version__,
                     "transformers": transformers.__version__},
        "setups": args.setups, "cells": [], "notes": [], "profile_parts": {"scopes": SCOPES, "patterns": PARTS},
    }  # fmt: skip

    def note(msg: str) -> None:
        print(msg, flush=True)
        res["notes"].append(msg)

    def free() -> None:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    def cell(**c) -> dict:
        res["cells"].append(c)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in c.items()
                       if k not in ("profile", "times_ms")), flush=True)  # fmt: skip
        return c

    chunked = fp4_moe_configs.ALIGN["chunked"]
    for k, setup in enumerate(args.setups):
        deadline = t_start + args.budget_s * (k + 1) / len(args.setups)
        fp4_moe_configs.ALIGN["chunked"] = chunked or setup == "fp4_chunked_align"
        fp4 = setup.startswith("fp4")
        lm = None
        try:
            t0 = time.perf_counter()
            spec = SimpleNamespace(smoke=args.smoke, layers=args.layers, freeze_experts=True,
                                   prefill_bf16_gemms=setup == "fp4_bf16_gemms")  # fmt: skip
            lm = build_model(spec, fp4, dev)
            lm.eval()
            w = weights_from_hf(lm)
            decoder = layout_of(lm.config).decoder
            kv_fp4 = kv_format(lm) is not None
            record = bool(fp4_experts(lm))  # the engine records hints wherever the model has FP4 experts
            note(f"setup {setup}: built in {time.perf_counter() - t0:.1f} s (kv_fp4={kv_fp4}, hints={record})")
        except Exception as e:
            note(f"setup {setup} failed to build: {type(e).__name__}: {e}"[:500])
            traceback.print_exc()
            for rows, P in args.cells:
                cell(setup=setup, rows=rows, prompt_tokens=P, status=f"error: setup did not build: {type(e).__name__}")
            lm = None
            free()
            continue
        gen = torch.Generator().manual_seed(0)
        for rows, P in args.cells:
            base = {"setup": setup, "rows": rows, "prompt_tokens": P}
            if time.perf_counter() > deadline:
                cell(**base, status=f"skipped: time budget (--budget-s {args.budget_s:g})")
                continue
            ids = mask = dec = cache = None
            try:
                prompts = torch.randint(4, lm.config.vocab_size, (rows, P), generator=gen).tolist()
                ids, mask = left_pad(prompts, lm.config.pad_token_id, dev, lm.config.vocab_size, width=P)
                lengths = mask.sum(1)
                if cuda:
                    torch.cuda.reset_peak_memory_stats()

                def prefill():
                    return EngineRollout._prefill(lm, ids, mask, kv_fp4, record)

                with torch.no_grad():
                    times = harness.call_times(prefill, args.repeats, warmup=1, cuda=cuda)
                    _, cache, _ = prefill()
                    dec = decoder(w, rows, -(-P // 256) * 256 if cuda else P, kv_fp4=kv_fp4, record_hints=False)
                    load = harness.time_per_call(lambda: EngineRollout._load_cache(dec, cache, lengths, P),
                                                 args.repeats, warmup=1, cuda=cuda)  # fmt: skip
                    dec = cache = None
                    fwd = statistics.median(times)
                    out = {"status": "ok", "forward_ms": fwd * 1e3, "load_cache_ms": load * 1e3,
                           "prefill_ms": (fwd + load) * 1e3, "tokens_per_s": rows * P / fwd,
                           "tokens_per_s_with_load": rows * P / (fwd + load),
                           "times_ms": [round(t * 1e3, 3) for t in times]}  # fmt: skip
                    if cuda:
                        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                    if args.profile:
                        with scoped(lm):
                            out["profile"] = prof = profile_parts(prefill, cuda)
                        if cuda:  # the timed forward's stream time that no kernel of the profiled one fills
                            prof["gpu_idle_ms"] = max(0.0, fwd * 1e3 - prof["total_ms"])
                    if args.sync_check and cuda:
                        out["sync_check"] = sync_check(prefill)
                cell(**base, **out)
            except Exception as e:  # an OOM (or any failure) of one cell must not lose the others
                cell(**base, status=f"error: {type(e).__name__}: {e}"[:500])
                if not isinstance(e, torch.OutOfMemoryError):
                    traceback.print_exc()
            finally:
                ids = mask = dec = cache = None
                free()
        lm = w = None
        free()
        if cuda:
            note(
                f"setup {setup}: done, {torch.cuda.memory_allocated() / 2**30:.1f} GiB still allocated after freeing it"
            )

    # ---- ratios and tables ----------------------------------------------------------------------------------
    ok = {(c["setup"], c["rows"], c["prompt_tokens"]): c for c in res["cells"] if c["status"] == "ok"}
    table = []
    for rows, P in args.cells:
        f, b = ok.get(("fp4", rows, P)), ok.get(("bf16", rows, P))
        row = {"rows": rows, "prompt_tokens": P}
        for name, c in (("fp4", f), ("bf16", b)):
            row[f"{name}_ms"] = c["forward_ms"] if c else None
            row[f"{name}_load_cache_ms"] = c["load_cache_ms"] if c else None
            row[f"{name}_tokens_per_s"] = c["tokens_per_s"] if c else None
        row["fp4_over_bf16"] = f["tokens_per_s"] / b["tokens_per_s"] if f and b else None
        row["fp4_over_bf16_with_load"] = f["tokens_per_s_with_load"] / b["tokens_per_s_with_load"] if f and b else None
        table.append(row)
    res["table"] = table
    res["seconds"] = time.perf_counter() - t_start
    harness.write_json(args.out, res)

    print(f"\n{'rows x tokens':>14} {'fp4 ms':>9} {'bf16 ms':>9} {'fp4 tok/s':>10} {'bf16 tok/s':>10} {'fp4/bf16':>8} "
          f"{'+load':>6} {'fp4 load':>8} {'bf16 load':>9}")  # fmt: skip
    for r in table:
        print(f"{r['rows']:>6} x {r['prompt_tokens']:<5} {harness.fmt(r['fp4_ms']):>9} {harness.fmt(r['bf16_ms']):>9} "
              f"{harness.fmt(r['fp4_tokens_per_s'], '.0f'):>10} {harness.fmt(r['bf16_tokens_per_s'], '.0f'):>10} "
              f"{harness.fmt(r['fp4_over_bf16'], '.2f'):>8} {harness.fmt(r['fp4_over_bf16_with_load'], '.2f'):>6} "
              f"{harness.fmt(r['fp4_load_cache_ms'], '.2f'):>8} {harness.fmt(r['bf16_load_cache_ms'], '.2f'):>9}")  # fmt: skip
    profiled = [c for c in res["cells"] if "profile" in c]
    if profiled:
        unit = "device ms" if cuda else "cpu ms (smoke: op time)"
        print(f"\nprofile, {unit} per part of one prefill:")
        short = {"routed_experts": "experts", "fp4_quant_kv_write": "quant+kv", "hint_recording": "hints",
                 "norms_elementwise": "norms/elt"}  # fmt: skip
        print(f"{'setup':>5} {'cell':>11} {'total':>9} " + " ".join(f"{short.get(p, p):>9}" for p in PART_NAMES)
              + (f" {'gpu idle':>9}" if cuda else ""))  # fmt: skip
        for c in profiled:
            prof = c["profile"]
            print(f"{c['setup']:>5} {c['rows']:>5}x{c['prompt_tokens']:<5} {prof['total_ms']:>9.2f} "
                  + " ".join(f"{prof['parts_ms'][p]:>9.2f}" for p in PART_NAMES)
                  + (f" {prof['gpu_idle_ms']:>9.2f}" if cuda else ""))  # fmt: skip
        for c in profiled:
            print(f"\ntop kernels, {c['setup']} {c['rows']}x{c['prompt_tokens']}:")
            for name, ms, part in c["profile"]["top_kernels"]:
                print(f"  {ms:>9.2f} ms  {part:<18} {name[:90]}")
    print(f"total {res['seconds']:.0f} s; JSON: {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
