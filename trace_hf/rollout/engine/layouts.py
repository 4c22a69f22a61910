# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""What the rollout engine reads from each model family: one `Layout` entry per family.

Why: Qwen3 MoE and Qwen3.5 MoE share the engine's prefill, sampler, stops, buckets, graphs and hint/routing
records, and differ in where their decode weights live (fused or gated projections, norms stored as ``1 + w``, a
shared expert, linear-attention layers). An entry names those differences, so a family is a row here and a
decoder step, not a copy of the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...models import has_lora, lora_weight
from .decoder import FastDecoder
from .qwen35 import HybridDecoder, HybridDecodeWeights, HybridDims, HybridLayerWeights, pad_rows
from .weights import DecodeWeights, Derived, Dims, LayerWeights, Reader, read_weights


@dataclass(frozen=True)
class Layout:
    """How the engine reads one family of transformers MoE causal LMs.

    Attributes:
        family: a name for messages.
        model_types: the text configs' ``model_type`` values of the family.
        mixers: decoder-layer attribute of the token mixer, by ``layer_types`` entry (``"full_attention"``: softmax
            attention with q/k norms and RoPE; ``"linear_attention"``: Gated DeltaNet).
        gated_attention: ``q_proj`` emits, per head, the query and then an output gate; attention output is
            multiplied by ``sigmoid(gate)`` before ``o_proj``.
        norm_offset: the model's RMSNorms scale by ``norm_offset + weight`` (Qwen3.5 stores ``weight`` centred on 0).
        shared_expert: MoE-block attributes of the shared expert MLP and its sigmoid gate (None: no shared expert).
        lora_targets: the linears, by path inside a decoder layer, whose PEFT LoRA adapters ``read_layer`` folds into
            the decode weights (`fold`); `support` refuses adapters anywhere else.
        dims: the `Dims` class read off the config.
        weights_type: the `DecodeWeights` class of the family.
        read_layer: the layout map: ``read_layer(layout, layer, i, dims, reader)`` -> the layer's decode weights,
            each tensor taken through ``reader`` (a parameter, or a `Derived` the engine computes and keeps fresh).
        decoder: the `FastDecoder` class whose step runs the family's layers.
    """

    family: str
    model_types: tuple[str, ...]
    mixers: dict[str, str]
    gated_attention: bool
    norm_offset: float
    shared_expert: tuple[str, str] | None
    lora_targets: tuple[str, ...]
    dims: type
    weights_type: type
    read_layer: Callable
    decoder: type

    @property
    def hybrid(self) -> bool:
        return "linear_attention" in self.mixers

    def norm(self, module) -> torch.Tensor | Derived:
        """An RMSNorm's decode weight: the parameter, or with a norm offset the fp32 ``offset + weight``."""
        if not self.norm_offset:
            return module.weight
        off = self.norm_offset
        return Derived(lambda full: full(module.weight).float() + off)


def fold(full, linear) -> torch.Tensor:
    """The weight a linear computes with, LoRA folded in: the one folding rule of every layout (`lora_weight`: PEFT's
    `get_delta_weight`, so ``lora_alpha / r`` or rsLoRA scaling, of each active adapter)."""
    return full(lora_weight(linear))


def linear_weight(linear) -> torch.Tensor | Derived:
    """A linear's decode weight: its parameter, read in place, or with an adapter the folded weight, recomputed at
    every refresh (after each optimizer step)."""
    return Derived(lambda full: fold(full, linear)) if has_lora(linear) else linear.weight


def _qwen3_layer(lay: Layout, layer, i: int, dims: Dims, r: Reader) -> LayerWeights:
    """Qwen3 MoE: a fused [q; k; v] projection, q/k norms, o_proj (each with its LoRA folded)."""
    a, m = layer.self_attn, layer.mlp
    qkv = Derived(lambda full: torch.cat([fold(full, a.q_proj), fold(full, a.k_proj), fold(full, a.v_proj)]))
    ln_in, w_qkv, q_norm, k_norm, w_o = (r.tensor(x) for x in (lay.norm(layer.input_layernorm), qkv,
                                         lay.norm(a.q_norm), lay.norm(a.k_norm), linear_weight(a.o_proj)))  # fmt: skip
    ln_post, w_router = r.tensor(lay.norm(layer.post_attention_layernorm)), r.tensor(m.gate.weight)
    gu, d, hinted, sites = r.experts(m.experts)
    return LayerWeights(ln_in, w_qkv, q_norm, k_norm, w_o, ln_post, w_router, gu, d, hinted, sites)


def _qwen35_layer(lay: Layout, layer, i: int, dims: HybridDims, r: Reader) -> HybridLayerWeights:
    """Qwen3.5 MoE: full attention's [q; k; v; gate] rows (``q_proj`` holds, per head, query then gate rows), or
    Gated DeltaNet's [qkv; z; b; a] rows with its conv, decay and gated norm; ``1 + w`` norms; the routed experts
    and the shared expert's [gate; up; sigmoid gate] rows. Every projection with its LoRA folded."""
    kind = dims.layer_types[i]
    mixer, mlp = getattr(layer, lay.mixers[kind]), layer.mlp
    D, Hq = dims.head_dim, dims.num_heads
    ln_in = r.tensor(lay.norm(layer.input_layernorm))
    if kind == "full_attention":

        def qkvg(full, a=mixer):
            q = fold(full, a.q_proj).view(Hq, 2 * D, -1)  # per head: query rows, then gate rows
            H = q.shape[-1]
            return torch.cat([q[:, :D].reshape(-1, H), fold(full, a.k_proj), fold(full, a.v_proj),
                              q[:, D:].reshape(-1, H)])  # fmt: skip

        w_in, w_out = r.tensor(Derived(qkvg)), r.tensor(linear_weight(mixer.o_proj))
        extra = {"q_norm": r.tensor(lay.norm(mixer.q_norm)), "k_norm": r.tensor(lay.norm(mixer.k_norm))}
    else:
        a = mixer
        w_in = r.tensor(Derived(lambda full: torch.cat([fold(full, a.in_proj_qkv), fold(full, a.in_proj_z),
                                                        fold(full, a.in_proj_b), fold(full, a.in_proj_a)])))  # fmt: skip
        w_out = r.tensor(linear_weight(mixer.out_proj))
        extra = {"conv": r.tensor(mixer.conv1d.weight).squeeze(1), "a_log": r.tensor(mixer.A_log),
                 "dt_bias": r.tensor(mixer.dt_bias), "gate_norm": r.tensor(mixer.norm.weight)}  # fmt: skip
    ln_post, w_router = r.tensor(lay.norm(layer.post_attention_layernorm)), r.tensor(mlp.gate.weight)
    gu, dn, hinted, sites = r.experts(mlp.experts)
    sh, sg = getattr(mlp, lay.shared_expert[0]), getattr(mlp, lay.shared_expert[1])
    w_shared = r.tensor(Derived(lambda full: pad_rows(torch.cat([fold(full, sh.gate_proj), fold(full, sh.up_proj),
                                                                 fold(full, sg)]))))  # fmt: skip
    return HybridLayerWeights(kind, ln_in, w_in, w_out, ln_post, w_router, gu, dn, w_shared,
                              r.tensor(linear_weight(sh.down_proj)), hinted=hinted, hint_sites=sites,
                              **extra)  # fmt: skip


#: The LoRA targets each layout folds (`Layout.lora_targets`): the attention projections, and on Qwen3.5 also the
#: Gated DeltaNet projections and the shared expert with its gate. Qwen3 MoE's engine has no dense or shared MLP.
ATTENTION_LORA = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
HYBRID_LORA = (
    *ATTENTION_LORA,
    *(f"linear_attn.{p}" for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")),
    *(f"mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
    "mlp.shared_expert_gate",
)
QWEN3_MOE = Layout("qwen3_moe", ("qwen3_moe",), {"full_attention": "self_attn"}, gated_attention=False,
                   norm_offset=0.0, shared_expert=None, lora_targets=ATTENTION_LORA, dims=Dims,
                   weights_type=DecodeWeights, read_layer=_qwen3_layer, decoder=FastDecoder)  # fmt: skip
QWEN3_5_MOE = Layout("qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"),
                     {"full_attention": "self_attn", "linear_attention": "linear_attn"}, gated_attention=True,
                     norm_offset=1.0, shared_expert=("shared_expert", "shared_expert_gate"),
                     lora_targets=HYBRID_LORA, dims=HybridDims,
                     weights_type=HybridDecodeWeights, read_layer=_qwen35_layer, decoder=HybridDecoder)  # fmt: skip
#: Every family the engine implements.
LAYOUTS: tuple[Layout, ...] = (QWEN3_MOE, QWEN3_5_MOE)


def layout_of(config) -> Layout | None:
    """The `Layout` of a model config (its text config decides), None for a family the engine does not implement."""
    mt = getattr(config.get_text_config(decoder=True), "model_type", None)
    return next((lay for lay in LAYOUTS if mt in lay.model_types), None)


def supported_model_types() -> tuple[str, ...]:
    return tuple(mt for lay in LAYOUTS for mt in lay.model_types)


def weights_from_hf(model) -> DecodeWeights:
    """The decode weights of a transformers causal LM of a family the engine implements (plain, or loaded with
    `TraceFP4Config`: FP4 experts give their packed weights and hinted flags). Here, not in `weights`: the layouts
    name the weights' classes, so the weights module cannot name the layouts."""
    return read_weights(model, layout_of(model.config), Reader())
