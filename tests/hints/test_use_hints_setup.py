# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`use_hints`' setup walks the model a fixed number of times, whatever its depth: the trainer enters it for every
micro-batch of every log-prob and training forward, with the GPU idle while it runs (docs/lab-notes.md 6b)."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from trace_hf import HintRecorder, TraceFP4Config, use_hints
from trace_hf import testing as T
from trace_hf.models import routers_of
from trace_hf.quant.experts import fp4_experts


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for layers in (2, 4, 8):
        path = T.save_tiny_model(tmp_path_factory.mktemp(f"l{layers}") / "m", num_hidden_layers=layers)
        out[layers] = AutoModelForCausalLM.from_pretrained(path, quantization_config=TraceFP4Config(hint_layers=1))
    return out


def recorded(model):
    """Two rows of six tokens and the hints a no-grad forward of ``model`` records for them (model left in train)."""
    ids = torch.randint(4, 60, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    model.eval()
    with torch.no_grad(), HintRecorder(model.model) as rec:
        model.model(input_ids=ids, attention_mask=mask)
    model.train()
    return ids, mask, rec.collect(mask)


def walks_in_use_hints(model, monkeypatch) -> int:
    ids, mask, hints = recorded(model)
    calls = []
    original = nn.Module.modules

    def counted(self):
        calls.append(self)
        return original(self)

    monkeypatch.setattr(nn.Module, "modules", counted)
    with use_hints(model.model, hints, mask):
        pass
    monkeypatch.setattr(nn.Module, "modules", original)
    return sum(1 for m in calls if m is model.model)


def test_use_hints_walks_the_model_a_fixed_number_of_times(models, monkeypatch):
    """Before, every MoE layer's router was found by its own walk (twice): 2 x 48 walks of 2,600 modules at full depth
    with LoRA, 0.6 s per micro-batch."""
    shallow, deep = (walks_in_use_hints(models[n], monkeypatch) for n in (2, 8))
    assert shallow == deep, f"use_hints walked the model {shallow} times at 2 layers and {deep} at 8"
    assert deep <= 3


def test_routers_of_gives_each_experts_module_its_own_router(models):
    model = models[8]
    experts = fp4_experts(model)
    routers = routers_of(model, experts)
    want = [layer.mlp.gate for layer in model.model.layers]
    assert len(routers) == len(experts) == 8
    assert all(r is w for r, w in zip(routers, want, strict=True))
    assert routers_of(model, experts[3:1:-1]) == [want[3], want[2]]  # the order asked for
    with pytest.raises(ValueError, match="not part of this model"):
        routers_of(model, [nn.Linear(2, 2)])


def syncs_in_hinted_forward(model) -> int:
    """Host syncs (`.item()`, `int(t)`, `.tolist()`: `aten._local_scalar_dense`) of one hinted training forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ids, mask, hints = recorded(model)
    seen = []

    class Syncs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten._local_scalar_dense:
                seen.append(func)
            return func(*args, **(kwargs or {}))

    with Syncs(), use_hints(model.model, hints, mask):
        model.model(input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()
    return len(seen)


def test_a_hinted_forward_syncs_the_host_a_fixed_number_of_times(models):
    """A sync per layer would make the GPU wait for the host's launches at every layer of every micro-batch (at 48
    layers each training forward already costs 0.3-0.4 s of host work at any length: docs/lab-notes.md 6c)."""
    shallow, deep = (syncs_in_hinted_forward(models[n]) for n in (4, 8))  # (2 layers: no MoE layer is unhinted)
    assert shallow == deep, f"{shallow} host syncs at 4 layers, {deep} at 8"
