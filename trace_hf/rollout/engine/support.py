# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""What the rollout engine can roll out: `unsupported_reason` (the one place that says why not), the KV format it
reads off the model, and the PEFT adapters it folds."""

from __future__ import annotations

import os
import re

from ...quant.experts import fp4_experts
from ...quant.kv_cache import kv_format
from ..base import causal_lm
from .layouts import LAYOUTS, Layout, layout_of, supported_model_types
from .weights import Dims, sharded


def unsupported_reason(model, require_cuda: bool = True) -> str | None:
    """Why the engine cannot roll out this model (None: it can). The engine implements the families of
    `trace_hf.rollout.engine.layouts`: Qwen3 MoE-style decoders whose every layer is full-attention MoE (q/k norms, default
    RoPE, SiLU experts, softmax top-k router), and Qwen3.5 MoE (Gated DeltaNet and gated full attention, shared
    expert)."""
    lm = causal_lm(model)
    text = lm.config.get_text_config(decoder=True)
    layout = layout_of(lm.config)
    if layout is None:
        return (f"model type {getattr(text, 'model_type', None)!r} is not one the engine implements "
                f"({', '.join(supported_model_types())})")  # fmt: skip
    adapters = _adapter_problems(lm, layout)
    if adapters:
        return adapters
    try:
        Dims.from_config(lm.config)
    except ValueError as e:
        return str(e)
    mixers = set(getattr(text, "layer_types", None) or ["full_attention"])
    if not mixers <= set(layout.mixers):
        return f"layer types {sorted(mixers - set(layout.mixers))} are not implemented for {layout.family}"
    if layout.hybrid and sharded(lm):
        return f"FSDP2-sharded {layout.family} models are not implemented (Qwen3 MoE ones are)"
    if getattr(text, "use_sliding_window", False):
        return "sliding-window attention is not implemented"
    if getattr(text, "hidden_act", "silu") != "silu":
        return f"experts activation {text.hidden_act!r} is not SiLU"
    if getattr(text, "attention_bias", False):
        return "attention biases are not implemented"
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in lm.modules()):
        return "FSDP1 flat parameters are not supported (FSDP2, `fully_shard`, is)"
    experts = fp4_experts(lm)
    if experts and any(m.fmt != "nvfp4" or m.activations != "fp4" for m in experts):
        return "its FP4 experts are not NVFP4 W4A4 (the engine's kernels)"
    if experts and len(experts) != text.num_hidden_layers:
        return "some MoE layers were left unquantized (modules_to_not_convert)"
    if kv_format(lm) not in (None, "nvfp4"):
        return f"its KV cache is {kv_format(lm)}, the engine's FP4 cache is NVFP4"
    device = next(lm.parameters()).device
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device.type != "cuda" and (require_cuda or not interpreted):
        return "the model is not on a CUDA device (the engine runs on CPU only under TRITON_INTERPRET=1, for tests)"
    return None


#: By family, the linears (paths inside a decoder layer) whose PEFT LoRA adapters the engine folds into its own
#: copies of their weights at every rollout (`Layout.lora_targets`).
LORA_TARGETS = {lay.family: lay.lora_targets for lay in LAYOUTS}


def _adapter_problems(lm, layout: Layout) -> str | None:
    """Why the engine cannot fold this model's PEFT adapters into its weights (None: it can, or there are none).
    Refused, so that no rollout decodes without an adapter the model computes with: adapters on the router, lm_head
    or embeddings (the engine reads those weights in place), on the routed experts' fused parameters (their packed
    FP4 codes come from the base weights), DoRA and other variants and lora_bias (not a plain ``B @ A`` delta), and
    modules_to_save."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:  # PEFT before 0.15
        from peft.utils.other import ModulesToSaveWrapper as AuxiliaryTrainingWrapper

    bad = []
    for name, m in lm.named_modules():
        if isinstance(m, AuxiliaryTrainingWrapper):
            bad.append(f"{name} ({type(m).__name__}: modules_to_save / trainable tokens)")
        elif isinstance(m, BaseTunerLayer):
            leaf = name.rsplit(".", 1)[-1]
            inside = re.search(r"(?:^|\.)layers\.\d+\.(.+)$", name)
            if not isinstance(m, LoraLinear) or not inside or inside.group(1) not in layout.lora_targets:
                bad.append(f"{name} ({type(m).__module__.split('.')[-2]} on {leaf})")
            elif any(
                getattr(m, attr, {}).get(a)
                for attr in ("lora_variant", "use_dora", "lora_bias")
                for a in m.active_adapters
            ):
                bad.append(f"{name} (a LoRA variant such as DoRA, or lora_bias)")
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        return (
            f"its PEFT adapters on {shown} are not folded into the engine's weights (the {layout.family} engine "
            f"folds plain LoRA on {list(layout.lora_targets)} of each decoder layer)"
        )
    return None
