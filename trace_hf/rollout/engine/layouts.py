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
from .weights import DecodeWeights, Derived, Dims, LayerWeights, Reader


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


def _qwen3_layer(lay: Layout, layer, i: int, dims: Dims, r: Reader) -> LayerWeights:
    """Qwen3 MoE: a fused [q; k; v] projection (LoRA folded), q/k norms, o_proj (LoRA folded where it has one)."""
    a, m = layer.self_attn, layer.mlp
    qkv = Derived(lambda full: torch.cat([full(lora_weight(a.q_proj)), full(lora_weight(a.k_proj)),
                                          full(lora_weight(a.v_proj))]))  # fmt: skip
    w_o = Derived(lambda full: full(lora_weight(a.o_proj))) if has_lora(a.o_proj) else a.o_proj.weight
    ln_in, w_qkv, q_norm, k_norm, w_o = (r.tensor(x) for x in (lay.norm(layer.input_layernorm), qkv,
                                         lay.norm(a.q_norm), lay.norm(a.k_norm), w_o))  # fmt: skip
    ln_post, w_router = r.tensor(lay.norm(layer.post_attention_layernorm)), r.tensor(m.gate.weight)
    gu, d, hinted, sites = r.experts(m.experts)
    return LayerWeights(ln_in, w_qkv, q_norm, k_norm, w_o, ln_post, w_router, gu, d, hinted, sites)


def _qwen35_layer(lay: Layout, layer, i: int, dims: HybridDims, r: Reader) -> HybridLayerWeights:
    """Qwen3.5 MoE: full attention's [q; k; v; gate] rows (``q_proj`` holds, per head, query then gate rows), or
    Gated DeltaNet's [qkv; z; b; a] rows with its conv, decay and gated norm; ``1 + w`` norms; the routed experts
    and the shared expert's [gate; up; sigmoid gate] rows."""
    kind = dims.layer_types[i]
    mixer, mlp = getattr(layer, lay.mixers[kind]), layer.mlp
    D, Hq = dims.head_dim, dims.num_heads
    ln_in = r.tensor(lay.norm(layer.input_layernorm))
    if kind == "full_attention":

        def qkvg(full, a=mixer):
            q = full(a.q_proj.weight).view(Hq, 2 * D, -1)  # per head: query rows, then gate rows
            H = q.shape[-1]
            return torch.cat([q[:, :D].reshape(-1, H), full(a.k_proj.weight), full(a.v_proj.weight),
                              q[:, D:].reshape(-1, H)])  # fmt: skip

        w_in, w_out = r.tensor(Derived(qkvg)), r.tensor(mixer.o_proj.weight)
        extra = {"q_norm": r.tensor(lay.norm(mixer.q_norm)), "k_norm": r.tensor(lay.norm(mixer.k_norm))}
    else:
        a = mixer
        w_in = r.tensor(Derived(lambda full: torch.cat([full(a.in_proj_qkv.weight), full(a.in_proj_z.weight),
                                                        full(a.in_proj_b.weight), full(a.in_proj_a.weight)])))  # fmt: skip
        w_out = r.tensor(mixer.out_proj.weight)
        extra = {"conv": r.tensor(mixer.conv1d.weight).squeeze(1), "a_log": r.tensor(mixer.A_log),
                 "dt_bias": r.tensor(mixer.dt_bias), "gate_norm": r.tensor(mixer.norm.weight)}  # fmt: skip
    ln_post, w_router = r.tensor(lay.norm(layer.post_attention_layernorm)), r.tensor(mlp.gate.weight)
    gu, dn, hinted, sites = r.experts(mlp.experts)
    sh, sg = getattr(mlp, lay.shared_expert[0]), getattr(mlp, lay.shared_expert[1])
    w_shared = r.tensor(Derived(lambda full: pad_rows(torch.cat([full(sh.gate_proj.weight), full(sh.up_proj.weight),
                                                                 full(sg.weight)]))))  # fmt: skip
    return HybridLayerWeights(kind, ln_in, w_in, w_out, ln_post, w_router, gu, dn, w_shared,
                              r.tensor(sh.down_proj.weight), hinted=hinted, hint_sites=sites, **extra)  # fmt: skip


QWEN3_MOE = Layout("qwen3_moe", ("qwen3_moe",), {"full_attention": "self_attn"}, gated_attention=False,
                   norm_offset=0.0, shared_expert=None, dims=Dims, weights_type=DecodeWeights,
                   read_layer=_qwen3_layer, decoder=FastDecoder)  # fmt: skip
QWEN3_5_MOE = Layout("qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"),
                     {"full_attention": "self_attn", "linear_attention": "linear_attn"}, gated_attention=True,
                     norm_offset=1.0, shared_expert=("shared_expert", "shared_expert_gate"), dims=HybridDims,
                     weights_type=HybridDecodeWeights, read_layer=_qwen35_layer, decoder=HybridDecoder)  # fmt: skip
#: Every family the engine implements.
LAYOUTS: tuple[Layout, ...] = (QWEN3_MOE, QWEN3_5_MOE)


def layout_of(config) -> Layout | None:
    """The `Layout` of a model config (its text config decides), None for a family the engine does not implement."""
    mt = getattr(config.get_text_config(decoder=True), "model_type", None)
    return next((lay for lay in LAYOUTS if mt in lay.model_types), None)


def supported_model_types() -> tuple[str, ...]:
    return tuple(mt for lay in LAYOUTS for mt in lay.model_types)
