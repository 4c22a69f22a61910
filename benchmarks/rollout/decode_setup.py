# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Benchmark-only helpers of the decode step: random weights of a given shape, random cache content, and the bytes
a step must read. The rollout engine (`trace_hf.rollout`) never needs them; the decode benchmarks and their tests do.
"""

from __future__ import annotations

import torch

from trace_hf.fp4 import FP4Tensor
from trace_hf.models import default_hint_layers
from trace_hf.rollout.engine import DecodeWeights, Dims, FastDecoder, LayerWeights, quantize_experts
from trace_hf.rollout.engine.kernels import kernels


def random_weights(
    dims: Dims,
    dtype=torch.bfloat16,
    device="cuda",
    fp4_experts: bool = True,
    hint_layers: int | None = None,
    seed: int = 0,
    shared: DecodeWeights | None = None,
) -> DecodeWeights:
    """Random weights with the given shapes, built directly as tensors (std 0.02, norms 1). With ``shared``,
    every non-expert tensor is taken from it (and its dense experts are quantized if ``fp4_experts``), so two
    setups of a benchmark hold one copy of the weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    H, D, E, NI = dims.hidden, dims.head_dim, dims.num_experts, dims.expert_dim
    n_hint = default_hint_layers(dims.num_layers) if hint_layers is None else hint_layers

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

    def ones(n):
        return torch.ones(n, dtype=dtype, device=device)

    if shared is not None:
        layers = []
        for i, lw in enumerate(shared.layers):
            gu, d = lw.gate_up, lw.down
            if fp4_experts and not isinstance(gu, FP4Tensor):
                gu, d = quantize_experts(gu, d)
            layers.append(LayerWeights(lw.ln_in, lw.w_qkv, lw.q_norm, lw.k_norm, lw.w_o, lw.ln_post, lw.w_router,
                                       gu, d, i >= dims.num_layers - n_hint))  # fmt: skip
        return DecodeWeights(dims, shared.embed, shared.norm, shared.lm_head, layers)
    layers = []
    for i in range(dims.num_layers):
        gu, d = rnd(E, 2 * NI, H), rnd(E, H, NI)
        if fp4_experts:
            gu, d = quantize_experts(gu, d)
        layers.append(
            LayerWeights(
                ones(H),
                rnd((dims.num_heads + 2 * dims.num_kv_heads) * D, H),
                ones(D),
                ones(D),
                rnd(H, dims.num_heads * D),
                ones(H),
                rnd(E, H),
                gu,
                d,
                i >= dims.num_layers - n_hint,
            )  # fmt: skip
        )
    return DecodeWeights(dims, rnd(dims.vocab, H), ones(H), rnd(dims.vocab, H), layers)


def fill_random_context(dec: FastDecoder, length: int, seed: int = 0) -> None:
    """Every sequence holds ``length`` cached tokens of random K/V (benchmarks: the step costs the same
    whatever the values)."""
    A = kernels().attention
    g = torch.Generator(device=dec.device).manual_seed(seed)
    for c in dec.caches:
        A.fill_random(c, g)
    dec.positions.fill_(length)
    dec.tokens.random_(0, dec.dims.vocab, generator=g)


def kv_bytes_read(dec: FastDecoder, length: int) -> int:
    A = kernels().attention
    per_tok = A.kv_bytes_per_token(dec.dims.num_kv_heads, dec.dims.head_dim, dec.kv_fp4,
                                   torch.finfo(dec.dtype).bits // 8)  # fmt: skip
    return per_tok * length * dec.batch * dec.dims.num_layers


def bytes_per_step(weights: DecodeWeights, batch: int, kv_bytes: int) -> dict:
    """Bytes a decode step must read at least: non-expert weights, the experts the batch is expected to touch
    (uniform routing: ``E * (1 - (1 - k/E)^B)`` distinct experts per layer), the lm_head and the KV cache."""
    d = weights.dims
    dense = sum(lw.nbytes_dense() for lw in weights.layers)
    head = weights.lm_head.numel() * weights.lm_head.element_size()
    distinct = d.num_experts * (1.0 - (1.0 - d.top_k / d.num_experts) ** batch)
    experts = distinct * weights.expert_bytes() * d.num_layers
    total = dense + head + experts + kv_bytes
    return {"dense_weights": dense, "lm_head": head, "experts": experts, "distinct_experts_per_layer": distinct,
            "kv": kv_bytes, "total": total}  # fmt: skip
