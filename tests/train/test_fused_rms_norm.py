# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`TraceGRPOConfig.fused_rms_norm`: `FusedRMSNorm` takes the place of transformers' RMSNorms of both weight forms.
On CPU its values and gradients are transformers' bit for bit; the same parameters, state dict and hooks stay; gated
norms and unknown classes keep transformers' module."""

from __future__ import annotations

import importlib

import pytest
import torch

from trace_hf import testing as T
from trace_hf.train.rms_norm import SCALED_AFTER_CAST, ZERO_CENTERED, FusedRMSNorm, fuse_rms_norms


pytestmark = pytest.mark.usefixtures("one_thread")


def _transformers_class(name):
    import transformers

    for module in dir(transformers.models):
        try:
            found = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name, None)
        except Exception:  # noqa: BLE001 - a model family with missing optional dependencies
            continue
        if found is not None:
            return found
    return None


@pytest.mark.parametrize("name", sorted(SCALED_AFTER_CAST | ZERO_CENTERED))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_is_transformers_bit_for_bit(name, dtype):
    """Each listed class's forward and gradients, as the fused module computes them off CUDA: a class listed under
    the wrong form fails here."""
    cls = _transformers_class(name)
    if cls is None:
        assert name not in ("Qwen3MoeRMSNorm", "Qwen3_5MoeRMSNorm"), "the target families' norms must exist"
        pytest.skip(f"{name} is not in this transformers")
    norm = cls(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.3)
    fused = FusedRMSNorm.replacing(norm)
    assert fused.zero_centered == (name in ZERO_CENTERED) and fused.weight is norm.weight
    g = torch.Generator().manual_seed(0)
    x, dy = ((torch.randn(6, 7, 48, generator=g) * 4).to(dtype) for _ in range(2))
    outs = []
    for m in (norm, fused):
        xi = x.clone().requires_grad_()
        y = m(xi)
        outs.append((y, *torch.autograd.grad(y, (xi, m.weight), dy.to(y.dtype))))
    for want, got in zip(*outs):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe_text"])
def test_fuse_rms_norms_keeps_the_model(family):
    model = T.tiny_model(family, num_hidden_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []
    handle = model.model.layers[0].post_attention_layernorm.register_forward_hook(lambda *a: calls.append(1))
    want = model(ids).logits
    names = [n for n, m in model.named_modules() if type(m).__name__ in SCALED_AFTER_CAST | ZERO_CENTERED]
    gated = [n for n, m in model.named_modules() if "Gated" in type(m).__name__]

    assert fuse_rms_norms(model) == len(names) > 0
    assert all(isinstance(model.get_submodule(n), FusedRMSNorm) for n in names)
    assert all(not isinstance(model.get_submodule(n), FusedRMSNorm) for n in gated)
    assert (family == "qwen3_5_moe_text") == bool(gated)
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
    got = model(ids).logits
    assert torch.equal(got, want)
    assert len(calls) == 2  # the hook registered before the swap still runs ...
    handle.remove()
    model(ids)
    assert len(calls) == 2  # ... and its handle still removes it
    assert fuse_rms_norms(model) == 0  # idempotent


def test_the_trainer_fuses_by_default(tmp_path):
    from datasets import Dataset

    from trace_hf.train import TraceGRPOConfig, TraceGRPOTrainer

    data = Dataset.from_dict({"prompt": ["1+1=", "2+2="]})
    for fused in (True, False):
        model = T.tiny_model("qwen3_moe", num_hidden_layers=2)
        args = TraceGRPOConfig(
            output_dir=str(tmp_path), rollout_precision="bf16", trace_hints=False, routing_replay=False,
            per_device_train_batch_size=2, num_generations=2, max_completion_length=4, report_to="none", bf16=False,
            use_cpu=True,
            fused_rms_norm=fused,
        )  # fmt: skip
        trainer = TraceGRPOTrainer(model, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                                   train_dataset=data, processing_class=T.build_char_tokenizer())  # fmt: skip
        count = sum(isinstance(m, FusedRMSNorm) for m in trainer.model.modules())
        assert trainer.fused_rms_norms == count == (2 * 4 + 1 if fused else 0)
