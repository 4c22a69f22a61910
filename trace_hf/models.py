# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""What trace-hf knows about the transformers MoE models it quantizes, in one place.

Why: the quantizer, the hints, the KV cache and the rollout engine all ask the same questions of a model or its
config (which decoder layers are MoE, which have full attention, the head size, which MoE layers carry hints by
default, where the router of an experts module is, whether that router is softmax top-k). Each answer is written
once here, from the config where the config alone decides.
"""

from __future__ import annotations

import torch
from torch import nn


#: The router classes routing replay can rebuild: softmax over the logits, top-k, renormalized per
#: ``norm_topk_prob`` (the Qwen3.5 router always renormalizes and has no such attribute).
SOFTMAX_TOPK_ROUTERS = ("Qwen3MoeTopKRouter", "Qwen3_5MoeTopKRouter", "Qwen2MoeTopKRouter", "Qwen3NextTopKRouter")


#: MoE blocks whose forward ends with the routed experts, so nothing after them in the decoder layer keeps a tensor
#: for backward: there the frozen experts keep what they save out of activation checkpointing, and the recompute
#: stops before them (`trace_hf.quant.expert_paths.kernel_train`). Qwen3.5's and Qwen2 MoE's blocks gate their shared
#: expert after the routed ones.
EXPERTS_LAST_BLOCKS = ("Qwen3MoeSparseMoeBlock",)


def text_config(config):
    """The decoder's config (a multimodal config's text part)."""
    return config.get_text_config(decoder=True)


def moe_layer_indices(config) -> list[int]:
    """Decoder layers of a Qwen-style config that are MoE, computed from the config alone."""
    text = text_config(config)
    if getattr(text, "num_experts", 0) in (0, None):
        return []
    step = getattr(text, "decoder_sparse_step", 1) or 1
    dense = set(getattr(text, "mlp_only_layers", None) or [])
    return [i for i in range(text.num_hidden_layers) if i not in dense and (i + 1) % step == 0]


def num_moe_layers(config) -> int:
    """MoE layers of a Qwen-style config, computed from the config alone."""
    return len(moe_layer_indices(config))


def full_attention_layers(config) -> list[int]:
    """Decoder layers with softmax attention and a K/V cache (all of them, unless ``layer_types`` says otherwise:
    Qwen3.5's Gated DeltaNet layers cache no K/V)."""
    text = text_config(config)
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    return [i for i, t in enumerate(types) if t == "full_attention"]


def head_dim(config) -> int:
    """Attention head size: ``head_dim`` where the config sets it, else hidden_size / num_attention_heads."""
    text = text_config(config)
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def default_hint_layers(num_moe: int) -> int:
    """The paper's default: hints on the deeper half of the MoE layers (rounded up)."""
    return (num_moe + 1) // 2


def is_skipped(name: str, modules_to_not_convert) -> bool:
    """Whether module `name` is one `modules_to_not_convert` names (full name, a suffix, or a parent)."""
    return any(name == m or name.endswith("." + m) or name.startswith(m + ".") for m in modules_to_not_convert)


def decoder_layers(model: nn.Module, experts_type: type) -> nn.ModuleList | None:
    """The decoder layers: the module list that holds the experts modules of type `experts_type`, or None."""
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and any(isinstance(m, experts_type) for m in mod.modules()):
            return mod
    return None


def routers_of(model: nn.Module, experts: list[nn.Module]) -> list[nn.Module]:
    """The router (`gate`, or `router`) beside each experts module in its MoE block, in `experts`' order.

    One walk over the model for all of them: a walk per experts module cost `use_hints` 0.6 s per micro-batch at
    48 layers with LoRA (2,600 modules; docs/lab-notes.md 6b), with the GPU idle."""
    gates = {}
    for block in model.modules():
        e = getattr(block, "experts", None)
        if isinstance(e, nn.Module):
            gates[id(e)] = block, getattr(block, "gate", None) or getattr(block, "router", None)
    out = []
    for m in experts:
        if id(m) not in gates:
            raise ValueError("The experts module is not part of this model.")
        block, gate = gates[id(m)]
        if gate is None:
            raise ValueError(f"{type(block).__name__} has no `gate`/`router` module next to its experts.")
        out.append(gate)
    return out


def softmax_topk_problems(model: nn.Module, is_experts) -> list[str]:
    """Why the routers of `model` are not plain softmax top-k (empty: they are), from the config's routing fields
    and the router beside the first experts module (``is_experts(module)``); routing replay rebuilds the top-k
    weights by that rule."""
    text = text_config(model.config)
    problems = []
    scoring = getattr(text, "scoring_func", None)
    if scoring not in (None, "softmax"):
        problems.append(f"scoring_func={scoring!r}")
    method = getattr(text, "topk_method", None)
    if method not in (None, "greedy"):
        problems.append(f"topk_method={method!r}")
    factor = getattr(text, "routed_scaling_factor", None)
    if factor not in (None, 1, 1.0):
        problems.append(f"routed_scaling_factor={factor}")
    for block in model.modules():
        experts, gate = getattr(block, "experts", None), getattr(block, "gate", None)
        if experts is not None and gate is not None and is_experts(experts):
            if hasattr(gate, "e_score_correction_bias"):
                problems.append(f"{type(gate).__name__} (sigmoid scores with a selection bias, grouped top-k)")
            break
    return problems


def is_softmax_topk_router(router: nn.Module) -> bool:
    """A router module routing replay can rebuild (a PEFT adapter on it computes the same rule)."""
    router = getattr(router, "base_layer", router)
    return type(router).__name__ in SOFTMAX_TOPK_ROUTERS or hasattr(router, "norm_topk_prob")


def lora_weight(linear: torch.nn.Module) -> torch.Tensor:
    """The weight a linear computes with now: a PEFT LoRA layer's base weight plus its active, unmerged adapters'
    delta (PEFT's own `get_delta_weight`, summed in fp32); any other linear's own weight."""
    base = getattr(linear, "base_layer", None)
    if base is None:
        return linear.weight
    active = [a for a in linear.active_adapters if a in linear.lora_A and a not in linear.merged_adapters]
    if linear.disable_adapters or not active:
        return base.weight
    w = base.weight.float()
    for a in active:
        w = w + linear.get_delta_weight(a).float()
    return w.to(base.weight.dtype)


def has_lora(linear: torch.nn.Module) -> bool:
    return getattr(linear, "base_layer", None) is not None
