# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""PEFT LoRA folded into the rollout engine's weights at every rollout, on Qwen3 MoE (the attention projections) and
Qwen3.5 MoE (full and linear attention, the shared expert and its gate): the folded weights are PEFT's merged
weights, the engine rolls out as `generate` before and after an optimizer step, what it cannot fold is refused,
and the trainer rolls a LoRA Qwen3.5 out through it. CPU: eager through the Triton interpreter, fp32."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from rollout_inputs import greedy_config, random_prompts

from trace_hf import TraceFP4Config
from trace_hf import testing as T
from trace_hf.quant.experts import fp4_experts
from trace_hf.quant.quantizer import quantize_model
from trace_hf.rollout import EngineRollout, GenerateRollout, make_rollout, unsupported_reason
from trace_hf.rollout.base import causal_lm
from trace_hf.rollout.engine import LORA_TARGETS, weights_from_hf


pytest.importorskip("trace_hf.kernels.sampling")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_thread")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
#: Every linear each family's engine folds LoRA on, as PEFT's target_modules.
TARGETS = {
    "qwen3_moe": ATTENTION,
    "qwen3_5_moe_text": [*ATTENTION, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "gate_proj",
                         "up_proj", "down_proj", "shared_expert_gate"],
}  # fmt: skip
SITES = ("experts_input", "experts_hidden", "kv")


def _model(family: str, fp4: bool = True):
    """Two layers (Qwen3.5: Gated DeltaNet, then gated full attention), FP4 experts hinted at every site."""
    model = T.tiny_model(family, num_hidden_layers=2)
    if fp4:
        quantize_model(model, TraceFP4Config(hint_layers=2, hint_sites=list(SITES)))
    return model.eval()


def _lora(model, family: str, **kw):
    """LoRA on every target the engine folds, with random (nonzero) B so that each adapter changes the policy."""
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[family], init_lora_weights=False, **kw)
    return peft.get_peft_model(model, cfg).eval()


def _adapters(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def test_targets_name_every_folded_linear():
    assert LORA_TARGETS["qwen3_moe"] == tuple(f"self_attn.{t}" for t in ATTENTION)
    leaves = {t.rsplit(".", 1)[-1] for t in LORA_TARGETS["qwen3_5_moe"]}
    assert leaves == set(TARGETS["qwen3_5_moe_text"])


@pytest.mark.parametrize("rslora", [False, True])
@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "qwen3_moe"])
def test_folded_weights_are_peft_merged_weights(family, rslora):
    """Every decode weight the engine reads from a LoRA model equals the one it reads from the same model with PEFT's
    `merge_and_unload` (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA), and every weight a target feeds differs
    from the base model's: no target is left out or folded twice."""
    model = _lora(_model(family, fp4=False), family, use_rslora=rslora)
    got = weights_from_hf(causal_lm(model))
    want = weights_from_hf(copy.deepcopy(model).merge_and_unload())
    with model.disable_adapter():
        base = weights_from_hf(causal_lm(model))
    fed = {"w_qkv", "w_o", "w_in", "w_out", "w_shared", "w_shared_down"}
    for lg, lw, lb in zip(got.layers, want.layers, base.layers, strict=True):
        for f in dataclasses.fields(lg):
            g, w, b = getattr(lg, f.name), getattr(lw, f.name), getattr(lb, f.name)
            if not isinstance(g, torch.Tensor):
                continue
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f.name)
            assert (f.name in fed) != torch.equal(g, b), f.name
    assert sum(f.name in fed for f in dataclasses.fields(got.layers[0])) == (4 if family == "qwen3_5_moe_text" else 2)


def _agree(model, eng, prompts, gc):
    """The engine's greedy rollout against generate's: same tokens, log-probs within 1e-4 (fp32: summation order
    only), hints and routing equal on > 99.9% (the test_qwen35_engine / test_rollout tolerances)."""
    a = GenerateRollout()(model, prompts, gc, record=True)
    b = eng(model, prompts, gc, record=True)
    assert a.completion_ids == b.completion_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-4, rtol=0)
    ha, hb = a.hints, b.hints
    assert (ha.mantissa_bits == hb.mantissa_bits).float().mean() > 0.999
    assert (ha.routing == hb.routing).float().mean() > 0.999
    return b


@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "qwen3_moe"])
def test_engine_rolls_out_as_generate_with_lora_before_and_after_a_step(family):
    """With LoRA on every target, the engine and generate agree; after an optimizer step on the adapters they agree
    again on a changed policy, and the engine refreshed its weights in place (the same decoder: graphs stay valid)."""
    model = _lora(_model(family), family)
    assert unsupported_reason(model, require_cuda=False) is None
    eng = make_rollout(model, "engine")
    assert isinstance(eng, EngineRollout)
    prompts, gc = random_prompts(model, (6, 2, 9)), greedy_config(max_new_tokens=5)
    before = _agree(model, eng, prompts, gc)
    dec = next(iter(eng._runners.values())).dec
    params = list(_adapters(model).values())
    g = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    torch.optim.Adam(params, lr=0.1).step()
    after = _agree(model, eng, prompts, gc)
    assert after.completion_ids != before.completion_ids
    assert next(iter(eng._runners.values())).dec is dec


@pytest.mark.parametrize(
    "config, refused",
    [
        ({"target_parameters": ["mlp.gate.weight"]}, r"mlp\.gate \(lora on gate\).*not folded"),
        ({"target_modules": ["in_proj_qkv", "lm_head"]}, r"lm_head \(lora on lm_head\).*not folded"),
        ({"target_modules": ["out_proj"], "use_dora": True}, r"out_proj \(a LoRA variant such as DoRA"),
        ({"target_modules": ["embed_tokens"]}, r"embed_tokens \(lora on embed_tokens\).*not folded"),
        ({"target_parameters": ["mlp.experts.gate_up_proj"]}, r"mlp\.experts \(lora on experts\).*not folded"),
    ],
)
def test_adapters_the_engine_cannot_fold_are_refused(config, refused):
    """Adapters on the router, lm_head, the embeddings, the routed experts' fused parameters, and DoRA: refused by
    name, with what the engine does fold."""
    model = peft.get_peft_model(_model("qwen3_5_moe_text", fp4=False), peft.LoraConfig(r=4, **config)).eval()
    with pytest.raises(ValueError, match=refused) as e:
        make_rollout(model, "engine")
    assert "linear_attn.in_proj_qkv" in str(e.value) and "mlp.shared_expert_gate" in str(e.value)


def test_trainer_rolls_out_lora_qwen35_through_the_engine(tmp_path, engine_grpo_step, engine_grpo_metrics):
    """A GRPO step of a LoRA Qwen3.5 with frozen packed FP4 experts and ``rollout_engine="engine"``: the engine
    rolled out, the adapters on every target kind trained, the expert codes stayed, and the trace metrics logged."""
    from transformers import AutoModelForCausalLM

    path = T.save_tiny_model(tmp_path / "tiny", "qwen3_5_moe_text", num_hidden_layers=2)
    quant = TraceFP4Config(hint_layers=2, freeze_experts=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=quant)
    model = _lora(model, "qwen3_5_moe_text")
    codes = [b.clone() for m in fp4_experts(model) for b in m.buffers()]
    assert codes and all(m.frozen for m in fp4_experts(model))
    trainer, logged, changed = engine_grpo_step(model)
    assert isinstance(trainer.rollout, EngineRollout) and trainer.rollout.stats.prefill_rows > 0
    assert changed and all("lora_" in n for n in changed)
    for part in ("self_attn", "linear_attn", "shared_expert.", "shared_expert_gate"):
        assert any(part in n for n in changed), part
    assert all(torch.equal(a, b) for a, b in zip(codes, [b for m in fp4_experts(model) for b in m.buffers()]))
    for key in engine_grpo_metrics:
        assert key in logged, key


def test_frozen_qwen35_experts_hold_codes_only_and_train_from_the_rollout_weights(tmp_path):
    """`TraceFP4Config(freeze_experts=True)` on Qwen3.5: the experts load as packed FP4 codes only (no BF16 master:
    the bytes held are the packed size, the codes those of the checkpoint's tensors), the training forward computes
    from them bit for bit as the rollout path does and gives the input a gradient, and the engine with LoRA on every
    target rolls out as generate."""
    from transformers import AutoModelForCausalLM

    from trace_hf import fp4

    path = T.save_tiny_model(tmp_path / "tiny", "qwen3_5_moe_text", num_hidden_layers=2)
    quant = TraceFP4Config(hint_layers=2, hint_sites=list(SITES), freeze_experts=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=quant)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    experts = fp4_experts(model)
    assert len(experts) == 2
    for m, layer in zip(experts, plain.model.layers, strict=True):
        assert m.frozen and not list(m.parameters())
        assert sum(t.numel() * t.element_size() for t in m.buffers()) == m.packed_nbytes()
        for q, w in zip(
            m.packed_weights(), (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj), strict=True
        ):
            ref = fp4.quantize(w.detach(), "nvfp4", scale="expert")
            assert torch.equal(q.packed, ref.packed) and torch.equal(q.block_scale, ref.block_scale)
    m = experts[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, m.hidden_dim, generator=g)
    idx = torch.stack([torch.randperm(m.num_experts, generator=g)[:2] for _ in range(12)])
    w = torch.softmax(torch.randn(12, 2, generator=g), -1)
    with torch.no_grad():
        rollout = m.eval()(x, idx, w)
    xi = x.clone().requires_grad_(True)
    y = m.train()(xi, idx, w)
    y.square().sum().backward()
    assert torch.equal(y.detach(), rollout) and xi.grad.abs().sum() > 0
    model = _lora(model, "qwen3_5_moe_text")
    _agree(model, EngineRollout(), random_prompts(model, (6, 2, 9)), greedy_config(max_new_tokens=5))
