# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`fused_rope`: within the context the attention layers rotate q and k with `trace_hf.kernels.rope` (here the
interpreter stands in for CUDA), and the model's logits and gradients are bit for bit those of transformers'
function; the context puts transformers' function back and does not wrap twice."""

from __future__ import annotations

import pytest
import torch

from trace_hf import testing as T
from trace_hf.train import rope as R


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe_text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_keeps_every_value(family, dtype, monkeypatch):
    from trace_hf.kernels import rope as kernel

    model = T.tiny_model(family, num_hidden_layers=4).to(dtype)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    (module,) = R.rope_modules(model)
    original = module.apply_rotary_pos_emb

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(ids).logits
        logits.float().logsumexp(-1).sum().backward()
        return logits, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want, want_grads = run()
    calls = []
    monkeypatch.setattr(R, "_use_kernel", lambda q: True)
    monkeypatch.setattr(kernel, "rope", lambda *a: calls.append(1) or kernel._Rope.apply(*a))
    with R.fused_rope(model), R.fused_rope(model):  # nested: wrapped once
        assert module.apply_rotary_pos_emb is not original
        got, got_grads = run()
    assert module.apply_rotary_pos_emb is original
    attention_layers = sum(
        t == "full_attention" for t in getattr(model.config, "layer_types", None) or ["full_attention"] * 4
    )
    assert len(calls) == 2 * attention_layers > 0  # q and k of every attention layer, once each
    assert torch.equal(got, want)
    assert len(got_grads) == len(want_grads) and all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))


def test_models_without_known_rope_are_left_alone():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert R.rope_modules(model) == []
    with R.fused_rope(model):
        assert model(torch.ones(1, 4)).shape == (1, 4)
