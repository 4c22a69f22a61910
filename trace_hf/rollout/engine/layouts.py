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

from .decoder import FastDecoder
from .qwen35 import HybridDecoder, HybridWeights


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
        weights: builds the engine's weight holder for a model: an object with ``w`` (the `DecodeWeights`) and
            ``refresh() -> bool`` (False: rebuilt, graphs are stale).
        decoder: the `FastDecoder` class whose step runs the family's layers.
    """

    family: str
    model_types: tuple[str, ...]
    mixers: dict[str, str]
    gated_attention: bool
    norm_offset: float
    shared_expert: tuple[str, str] | None
    weights: Callable
    decoder: type

    @property
    def hybrid(self) -> bool:
        return "linear_attention" in self.mixers


def _qwen3_weights(lm):
    from .rollout import _sharded, _ShardedWeights, _Weights

    return (_ShardedWeights if _sharded(lm) else _Weights)(lm)


def _qwen35_weights(lm):
    return HybridWeights(lm, QWEN3_5_MOE)


QWEN3_MOE = Layout("qwen3_moe", ("qwen3_moe",), {"full_attention": "self_attn"}, gated_attention=False,
                   norm_offset=0.0, shared_expert=None, weights=_qwen3_weights, decoder=FastDecoder)  # fmt: skip
QWEN3_5_MOE = Layout("qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"),
                     {"full_attention": "self_attn", "linear_attention": "linear_attn"}, gated_attention=True,
                     norm_offset=1.0, shared_expert=("shared_expert", "shared_expert_gate"), weights=_qwen35_weights,
                     decoder=HybridDecoder)  # fmt: skip
#: Every family the engine implements.
LAYOUTS: tuple[Layout, ...] = (QWEN3_MOE, QWEN3_5_MOE)


def layout_of(config) -> Layout | None:
    """The `Layout` of a model config (its text config decides), None for a family the engine does not implement."""
    mt = getattr(config.get_text_config(decoder=True), "model_type", None)
    return next((lay for lay in LAYOUTS if mt in lay.model_types), None)


def supported_model_types() -> tuple[str, ...]:
    return tuple(mt for lay in LAYOUTS for mt in lay.model_types)
