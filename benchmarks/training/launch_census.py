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
(`grpo_step --profile-host`, `--profile train`).

It also counts the calls that make the host wait for the device (`SYNCS`: a value read back, an output sized by the
data), per layer (none: a layer could be captured in a CUDA graph) and per forward.

Each launch also counts the bytes of the tensors it reads and writes (its tensor arguments and outputs, whole), by
class (`OP_CLASSES`: GEMM, attention, copy/gather, reduction, elementwise, Triton) and by source: the traffic the
glue between the matmuls costs, which bounds the training side at large token counts (docs/benchmarks.md, "Where
does the training side's device time go?"). ``--shape mid`` gives the model the real shape's ratios (top-8 of 16
experts, hidden 2.7x the experts' width, 32 query heads per 4 KV) at a size the interpreter runs, so that the bytes
of [tokens x top-k] and [tokens] tensors weigh as they do at full size.

    TRITON_INTERPRET=1 python -m benchmarks.training.launch_census --out census.json
    TRITON_INTERPRET=1 python -m benchmarks.training.launch_census --shape mid --tokens 256 --out census_mid.json

Per layer = (count at ``--layers`` + 2) - (count at ``--layers``), halved: the embedding, the final norm and the LM
head cancel out, and for FP4 it is the mean of a hinted and an unhinted layer (the default hints the deeper half).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys

from benchmarks import harness


#: aten calls that only make views or read metadata: no kernel on the GPU.
METADATA = frozenset({
    "view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "slice", "expand", "detach", "alias",
    "as_strided", "select", "split", "split_with_sizes", "permute", "lift_fresh", "_reshape_alias", "unbind", "chunk",
    "narrow", "reshape", "empty", "empty_like", "empty_strided", "sym_size", "is_same_size", "_local_scalar_dense",
    "item", "unflatten", "flatten", "view_as", "contiguous", "_has_compatible_shallow_copy_type", "new_empty",
    "promote_types", "result_type",
})  # fmt: skip
#: aten calls that make the host wait for the device on CUDA: a value read back (``.item()``, ``int(t)``, ``bool(t)``)
#: or an output sized by the data. One inside a decoder layer stalls every layer and rules out capturing it in a
#: CUDA graph. (A ``.tolist()`` or ``.cpu()`` of a CUDA tensor is a device copy, which a CPU census cannot see.)
SYNCS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
                   "unique_dim", "bincount"})  # fmt: skip
#: Launch classes by aten op name (a Triton launch is its own class); the rest is elementwise.
OP_CLASSES = {
    "gemm": {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "addmv", "mv", "dot"},
    "attention": {"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward", "_efficient_attention_forward",
                  "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_flash_attention_for_cpu_backward",
                  "_scaled_dot_product_efficient_attention_backward", "_flash_attention_backward",
                  "_efficient_attention_backward", "_scaled_dot_product_attention_math"},
    "copy/gather": {"index", "index_select", "gather", "scatter", "scatter_add", "scatter_add_", "index_put_",
                    "index_put", "copy_", "cat", "_to_copy", "clone", "masked_scatter", "index_copy", "index_copy_",
                    "slice_scatter", "select_scatter", "stack", "embedding", "embedding_dense_backward",
                    "index_add_", "index_add", "masked_select", "nonzero", "repeat", "repeat_interleave"},
    "reduce/sort": {"sum", "mean", "amax", "amin", "max", "min", "sort", "topk", "cumsum", "_softmax", "_log_softmax",
                    "logsumexp", "argmax", "norm", "linalg_vector_norm", "_softmax_backward_data",
                    "_log_softmax_backward_data", "any", "all", "var_mean", "prod"},
}  # fmt: skip


def op_class(name: str) -> str:
    return next((c for c, ops in OP_CLASSES.items() if name in ops), "elementwise")


def _nbytes(obj) -> int:
    """Bytes of every tensor in a (nested) argument or output."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(o) for o in obj.values())
    return 0


#: Source folders a launch is attributed to (the innermost frame in one of them).
SOURCES = ("/trace_hf/", "/kernels/", "/peft/", "/transformers/models/", "/transformers/integrations/")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=2, help="the smaller of the two depths compared (the other: +2)")
    p.add_argument("--tokens", type=int, default=48, help="tokens of the one row")
    p.add_argument("--setups", default="bf16,fp4")
    p.add_argument("--shape", choices=["tiny", "mid", "mid_qwen35", "tiny_qwen35"], default="tiny",
                   help="tiny: the smoke model; mid: the real shape's ratios at an interpretable size (for bytes); "
                        "mid_qwen35: Qwen3.5-35B-A3B's, per layer of its 3 Gated DeltaNet + 1 attention period; "
                        "tiny_qwen35: the same layer types at the smoke size (which paths run, not their bytes)")  # fmt: skip
    p.add_argument("--amp", action="store_true",
                   help="as the GPU trains (grpo_step, bf16=True): bf16 weights, PEFT's default fp32 adapters and the "
                        "forwards under bf16 autocast, the adapters fed their input uncast (disable_input_dtype_casting; "
                        "--keep-adapter-casts: PEFT's casts); default: fp32 throughout")  # fmt: skip
    harness.add_kernel_flags(p)
    p.add_argument("--smoke", action="store_true", help="accepted for the benchmarks' common interface (always CPU)")
    args = p.parse_args(argv)
    if args.keep_adapter_casts and not args.amp:
        p.error("--keep-adapter-casts compares PEFT's casts under autocast: pass --amp too")
    return args


class Census:
    """Counts launching aten calls (by name and by source function) and Triton launches while `active`."""

    def __init__(self):
        self._in_triton = 0
        self.reset()

    def reset(self) -> None:
        self.ops, self.sources, self.triton = collections.Counter(), collections.Counter(), 0
        self.syncs = collections.Counter()  # `SYNCS` calls by source
        # Bytes by class, and the glue's by source and by op (autograd's backward ops have no Python source).
        self.bytes, self.source_bytes, self.op_bytes = (collections.Counter() for _ in range(3))

    def add_bytes(self, cls: str, n: int, source: str, op: str) -> None:
        self.bytes[cls] += n
        if cls in ("elementwise", "copy/gather", "reduce/sort"):
            self.source_bytes[source] += n
            self.op_bytes[op] += n

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
    from trace_hf.train import delta_rule, rms_norm, rope

    run = interpreter.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        census.triton += 1
        census.add_bytes("triton", _nbytes(args), "triton", "triton")
        census._in_triton += 1  # the interpreter's own torch calls are not launches
        try:
            return run(self, *args, **kwargs)
        finally:
            census._in_triton -= 1

    interpreter.InterpretedFunction.run = counted_run
    fp4._use_triton = lambda x, backend: backend != "torch"  # "auto" is Triton on CUDA
    expert_paths.grouped_mm_ok = lambda x, w: True  # one grouped GEMM, not a loop over the experts hit
    rms_norm._use_kernel = lambda x, weight: True  # `FusedRMSNorm` runs its kernels, as on CUDA
    rope._use_kernel = lambda q: True  # and `fused_rope` its kernel
    delta_rule._use_kernel = lambda q: True  # and the recurrent values of Gated DeltaNet theirs
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
            out = func(*args, **(kwargs or {}))
            if name in SYNCS and not census._in_triton:
                census.syncs[census.source()] += 1
            if name not in METADATA and not census._in_triton:
                source = census.source()
                census.ops[name] += 1
                census.sources[source] += 1
                census.add_bytes(op_class(name), _nbytes(args) + _nbytes(kwargs) + _nbytes(out), source, name)
            return out

    return Mode


#: Qwen3.5-35B-A3B's shape at hidden 256: head sizes divided by 8 (kept powers of two), the experts' width kept at a
#: quarter of the hidden size, the head counts kept.
MID_QWEN35 = {"hidden_size": 256, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 32,
              "num_experts": 16, "num_experts_per_tok": 8, "moe_intermediate_size": 64, "vocab_size": 1024,
              "shared_expert_intermediate_size": 64, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
              "linear_key_head_dim": 16, "linear_value_head_dim": 16}  # fmt: skip


def mid_model(layers: int, fp4: bool):
    """`lora_model`'s model at ``--shape mid``: Qwen3-30B-A3B's ratios (top-8 of many experts, hidden 2048 / expert
    width 768, 32 query / 4 KV heads) at hidden 256, frozen experts, LoRA r=32 on q/k/v/o, checkpointing."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeConfig

    from benchmarks.training.grpo_step import build_frozen

    cfg = Qwen3MoeConfig(num_hidden_layers=layers, hidden_size=256, num_attention_heads=32, num_key_value_heads=4,
                         head_dim=16, num_experts=16, num_experts_per_tok=8, moe_intermediate_size=96,
                         intermediate_size=512, vocab_size=1024, max_position_embeddings=4096,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    model = build_frozen(cfg, fp4, torch.device("cpu"), torch.float32)
    lora = LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(model, lora)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def qwen35_model(layers: int, fp4: bool, tiny: bool = False):
    """Qwen3.5-35B-A3B's ratios at hidden 256 (head sizes / 8, top-8 of 16 experts of width 64 and a shared one, Gated
    DeltaNet 3 layers of every 4), frozen experts, LoRA r=32 on every target the hybrid engine folds, checkpointing;
    ``tiny``: `grpo_step_qwen35`'s smoke size instead (4 value heads, not 32: the interpreter runs a program each)."""
    from types import SimpleNamespace

    import torch
    from peft import LoraConfig, get_peft_model

    from benchmarks.training.grpo_step_qwen35 import build_model
    from trace_hf.rollout.engine.layouts import layout_of

    args = SimpleNamespace(smoke=tiny, layers=layers, freeze_experts=True)
    model = build_model(args, fp4, torch.device("cpu"), shape=None if tiny else MID_QWEN35)
    targets = list(layout_of(model.config).lora_targets)
    model = get_peft_model(model, LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, target_modules=targets))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def count(setup: str, layers: int, tokens: int, census: Census, mode, shape: str = "tiny", fused: bool = True,
          amp: bool = False, uncast: bool = True) -> dict:  # fmt: skip
    """One setup at one depth: the counts of a no-grad forward and of a forward + backward; with ``amp`` in the GPU
    trainer's precision (bf16 weights, fp32 adapters, bf16 autocast; ``uncast``: `autocast_adapter_inputs`)."""
    import torch

    from benchmarks.training.frozen_train_side import lora_model, record_hints
    from trace_hf import use_hints
    from trace_hf.hints import aligned_positions
    from trace_hf.train.adapter_casts import autocast_adapter_inputs, uncastable_adapters
    from trace_hf.train.delta_rule import delta_rule_modules, recurrent_values
    from trace_hf.train.rms_norm import fuse_rms_norms
    from trace_hf.train.rope import fused_rope

    fp4 = setup == "fp4"
    if shape == "mid":
        model = mid_model(layers, fp4)
    elif shape in ("mid_qwen35", "tiny_qwen35"):
        model = qwen35_model(layers, fp4, tiny=shape == "tiny_qwen35")
    else:
        model = lora_model(layers, fp4, torch.device("cpu"), smoke=True)
    if amp:  # a bf16 model whose PEFT adapters stayed fp32 (PEFT's default, which TRL keeps)
        for name, p in model.named_parameters():
            if "lora_" not in name and p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)
    if fused:
        fuse_rms_norms(model)  # as TraceGRPOTrainer does by default
    ids = torch.randint(4, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    hints = record_hints(model, ids, mask, "triton") if fp4 else None  # the rollout's kernels, as on CUDA

    def ctx():
        stack = contextlib.ExitStack()
        if amp:  # accelerate's bf16 mixed precision, and the trainer's uncast adapter inputs under it
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
            if uncast:
                stack.enter_context(autocast_adapter_inputs(uncastable_adapters(model)))
        if fused:
            stack.enter_context(fused_rope(model))  # as TraceGRPOTrainer's forwards do by default
        if delta_rule_modules(model):
            stack.enter_context(recurrent_values(model))  # gated_delta_rule="auto" on Qwen3.5
        if fp4:
            stack.enter_context(use_hints(model, hints, mask, routing_replay=True, apply_hints=True))
        else:
            stack.enter_context(aligned_positions(model, mask))
        return stack

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
                      "sources": dict(census.sources), "bytes": dict(census.bytes),
                      "glue_bytes_by_source": dict(census.source_bytes),
                      "glue_bytes_by_op": dict(census.op_bytes), "syncs": dict(census.syncs)}  # fmt: skip
    return out


def per_layer(shallow: dict, deep: dict, span: int = 2) -> dict:
    """Counts per decoder layer: the difference of two depths ``span`` layers apart, divided by ``span``."""

    def diff(a: dict, b: dict) -> dict:
        keys = set(a) | set(b)
        return {k: (b.get(k, 0) - a.get(k, 0)) / span for k in keys if b.get(k, 0) != a.get(k, 0)}

    res = {}
    for phase in shallow:
        a, b = shallow[phase], deep[phase]
        sources = sorted(diff(a["sources"], b["sources"]).items(), key=lambda kv: -kv[1])
        res[phase] = {
            "aten_per_layer": (b["aten"] - a["aten"]) / span,
            "triton_per_layer": (b["triton"] - a["triton"]) / span,
            "sources_per_layer": sources,
            "syncs_per_layer": sorted(diff(a["syncs"], b["syncs"]).items(), key=lambda kv: -kv[1]),
            "syncs_whole_forward": a["syncs"],  # at the smaller depth: with none per layer, the model's own
            "ops_per_layer": sorted(diff(a["ops"], b["ops"]).items(), key=lambda kv: -kv[1]),
            "bytes_per_layer": dict(sorted(diff(a["bytes"], b["bytes"]).items(), key=lambda kv: -kv[1])),
            "glue_bytes_per_layer_by_source": sorted(
                diff(a["glue_bytes_by_source"], b["glue_bytes_by_source"]).items(), key=lambda kv: -kv[1]
            )[:15],
            "glue_bytes_per_layer_by_op": sorted(
                diff(a["glue_bytes_by_op"], b["glue_bytes_by_op"]).items(), key=lambda kv: -kv[1]
            )[:15],
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
        fused = not args.no_fused
        span = 4 if args.shape.endswith("qwen35") else 2  # a whole period of Qwen3.5's layer types
        kw = {"fused": fused, "amp": args.amp, "uncast": not args.keep_adapter_casts}
        shallow = count(setup, args.layers, args.tokens, census, mode, args.shape, **kw)
        deep = count(setup, args.layers + span, args.tokens, census, mode, args.shape, **kw)
        results[setup] = per_layer(shallow, deep, span)
        for phase, r in results[setup].items():
            mb = {c: round(n / 2**20, 2) for c, n in r["bytes_per_layer"].items()}
            print(f"{setup} {phase}: {r['aten_per_layer']:.1f} aten launches + {r['triton_per_layer']:.1f} Triton "
                  f"launches per layer; top sources {r['sources_per_layer'][:4]}; MiB per layer by class {mb}; host syncs "
                  f"per layer {r['syncs_per_layer'] or 0}, per forward {r['syncs_whole_forward']}",
                  flush=True)  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"layers": [args.layers, args.layers + span], "tokens": args.tokens, "shape": args.shape,
                   "fused": not args.no_fused, "amp": args.amp, "adapter_casts": args.keep_adapter_casts or not args.amp,
                   "results": results}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
