# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""How many launches one decoder layer's training-side forward makes, counted on the CPU, and where they come from.

At one or a few rows per micro-batch the training side is bound by the host: every launch costs a few microseconds
of Python and driver time whatever its size (issue 51; docs/lab-notes.md 6c). This census counts, per decoder layer
of frozen-expert GRPO's training forward (PEFT LoRA r=32 on q/k/v/o, gradient checkpointing, `use_hints` with routing
replay for FP4, `aligned_positions` for BF16), the aten calls that launch work (views and other metadata calls are
left out) and the Triton launches, with the trace-hf, PEFT or transformers function each comes from. It runs under
the Triton interpreter with the GPU's dispatch: trace-hf's FP4 code takes its Triton paths (quantization,
dequantization, the experts' alignment) and its grouped GEMMs one `grouped_mm`, as on CUDA (on the CPU they would
take torch ones and a loop over the experts hit). What it cannot see: the Gluon (sm_90) expert kernels, which the
CPU replaces by the Triton ones one for one, and the kernels an aten call launches inside (cuBLAS, sdpa), counted
as one each. So it compares setups and code versions; GPU time is for the profiler
(`grpo_step --profile-host`).

    TRITON_INTERPRET=1 python -m benchmarks.training.launch_census --out census.json

Per layer = (count at ``--layers`` + 2) - (count at ``--layers``), halved: the embedding, the final norm and the LM
head cancel out, and for FP4 it is the mean of a hinted and an unhinted layer (the default hints the deeper half).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys


#: aten calls that only make views or read metadata: no kernel on the GPU.
METADATA = frozenset({
    "view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "slice", "expand", "detach", "alias",
    "as_strided", "select", "split", "split_with_sizes", "permute", "lift_fresh", "_reshape_alias", "unbind", "chunk",
    "narrow", "reshape", "empty", "empty_like", "empty_strided", "sym_size", "is_same_size", "_local_scalar_dense",
    "item", "unflatten", "flatten", "view_as", "contiguous", "_has_compatible_shallow_copy_type",
})  # fmt: skip
#: Source folders a launch is attributed to (the innermost frame in one of them).
SOURCES = ("/trace_hf/", "/kernels/", "/peft/", "/transformers/models/", "/transformers/integrations/")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=2, help="the smaller of the two depths compared (the other: +2)")
    p.add_argument("--tokens", type=int, default=48, help="tokens of the one row")
    p.add_argument("--setups", default="bf16,fp4")
    p.add_argument("--smoke", action="store_true", help="accepted for the benchmarks' common interface (always CPU)")
    return p.parse_args(argv)


class Census:
    """Counts launching aten calls (by name and by source function) and Triton launches while `active`."""

    def __init__(self):
        self._in_triton = 0
        self.reset()

    def reset(self) -> None:
        self.ops, self.sources, self.triton = collections.Counter(), collections.Counter(), 0

    def source(self) -> str:
        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename
            hit = next((s for s in SOURCES if s in name), None)
            if hit is not None:
                return name[name.index(hit) + 1 :] + ":" + f.f_code.co_name
            f = f.f_back
        return "other"


def _install(census: Census):
    """Route the interpreter's launches and trace-hf's backend choices through `census` (the GPU's dispatch)."""
    import triton.runtime.interpreter as interpreter
    from torch.utils._python_dispatch import TorchDispatchMode

    import trace_hf.fp4 as fp4
    from trace_hf.kernels import moe_align
    from trace_hf.quant import expert_paths

    run = interpreter.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        census.triton += 1
        census._in_triton += 1  # the interpreter's own torch calls are not launches
        try:
            return run(self, *args, **kwargs)
        finally:
            census._in_triton -= 1

    interpreter.InterpretedFunction.run = counted_run
    fp4._use_triton = lambda x, backend: backend != "torch"  # "auto" is Triton on CUDA
    expert_paths.grouped_mm_ok = lambda x, w: True  # one grouped GEMM, not a loop over the experts hit
    from trace_hf.kernels.fp4_quant import dequantize

    expert_paths.dequantize = dequantize  # `expert_weights.dequantize` on CUDA: the Triton kernel
    align = moe_align.moe_align

    def gpu_align(topk_ids, num_experts, block_m=None, backend="auto"):
        if backend == "auto" and topk_ids.shape[0] > 1:  # CUDA's choice: one launch up to the kernel's limit
            backend = "triton" if topk_ids.numel() <= moe_align.ALIGN_KERNEL_MAX else "chunks"
        return align(topk_ids, num_experts, block_m, backend)

    for mod in [m for m in list(sys.modules.values()) if getattr(m, "moe_align", None) is align]:
        mod.moe_align = gpu_align

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in METADATA and not census._in_triton:
                census.ops[name] += 1
                census.sources[census.source()] += 1
            return func(*args, **(kwargs or {}))

    return Mode


def count(setup: str, layers: int, tokens: int, census: Census, mode) -> dict:
    """One setup at one depth: the counts of a no-grad forward and of a forward + backward."""
    import torch

    from benchmarks.training.frozen_train_side import lora_model, record_hints
    from trace_hf import use_hints
    from trace_hf.hints import aligned_positions

    fp4 = setup == "fp4"
    model = lora_model(layers, fp4, torch.device("cpu"), smoke=True)
    ids = torch.randint(4, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    hints = record_hints(model, ids, mask, "triton") if fp4 else None  # the rollout's kernels, as on CUDA

    def ctx():
        if fp4:
            return use_hints(model, hints, mask, routing_replay=True, apply_hints=True)
        return aligned_positions(model, mask)

    out = {}
    for phase in ("no_grad_forward", "forward_backward"):
        census.reset()
        with mode():
            if phase == "no_grad_forward":
                with torch.no_grad(), ctx():
                    model(input_ids=ids, attention_mask=mask, logits_to_keep=tokens // 2)
            else:
                with ctx():
                    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=tokens // 2).logits
                    logits.float().logsumexp(-1).mean().backward()
        out[phase] = {"aten": sum(census.ops.values()), "triton": census.triton, "ops": dict(census.ops),
                      "sources": dict(census.sources)}  # fmt: skip
    return out


def per_layer(shallow: dict, deep: dict) -> dict:
    """Counts per decoder layer: the difference of two depths 2 layers apart, halved."""

    def diff(a: dict, b: dict) -> dict:
        keys = set(a) | set(b)
        return {k: (b.get(k, 0) - a.get(k, 0)) / 2 for k in keys if b.get(k, 0) != a.get(k, 0)}

    res = {}
    for phase in shallow:
        a, b = shallow[phase], deep[phase]
        sources = sorted(diff(a["sources"], b["sources"]).items(), key=lambda kv: -kv[1])
        res[phase] = {
            "aten_per_layer": (b["aten"] - a["aten"]) / 2,
            "triton_per_layer": (b["triton"] - a["triton"]) / 2,
            "sources_per_layer": sources,
            "ops_per_layer": sorted(diff(a["ops"], b["ops"]).items(), key=lambda kv: -kv[1]),
        }
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("launch_census runs the Triton kernels under the interpreter: set TRITON_INTERPRET=1.", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    census = Census()
    mode = _install(census)
    results = {}
    for setup in args.setups.split(","):
        shallow = count(setup, args.layers, args.tokens, census, mode)
        deep = count(setup, args.layers + 2, args.tokens, census, mode)
        results[setup] = per_layer(shallow, deep)
        for phase, r in results[setup].items():
            print(f"{setup} {phase}: {r['aten_per_layer']:.1f} aten launches + {r['triton_per_layer']:.1f} Triton "
                  f"launches per layer; top sources {r['sources_per_layer'][:4]}", flush=True)  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"layers": [args.layers, args.layers + 2], "tokens": args.tokens, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
