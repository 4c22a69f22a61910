# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Frozen packed FP4 experts (`TraceFP4Config(freeze_experts=True)`) and PEFT LoRA: loading holds no BF16 experts,
training computes from the rollout's packed weights, the engine folds the current adapter in, save/export/reload.
CPU: the engine runs eagerly through the Triton interpreter, fp32."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from trace_hf import TraceFP4Config, fp4
from trace_hf import testing as T
from trace_hf.quant.experts import TraceFP4Experts, fp4_experts
from trace_hf.rollout import EngineRollout, GenerateRollout, make_rollout


pytest.importorskip("trace_hf.kernels.sampling")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_thread")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return T.save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3_moe", num_hidden_layers=2)


def load(path, dtype=torch.float32, **quant):
    quant = {"hint_layers": 2, "freeze_experts": True, **quant}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=TraceFP4Config(**quant))


def lora(model, **kw):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, init_lora_weights=False, **kw)
    return peft.get_peft_model(model, cfg)


def prompts(vocab, lengths=(5, 3, 7), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(**kw):
    return GenerationConfig(**{"max_new_tokens": 5, "do_sample": False, "eos_token_id": [1], "pad_token_id": 0, **kw})


# ----------------------------------------------------------------------------------------------------------
# Frozen experts: loading, weights, gradients
# ----------------------------------------------------------------------------------------------------------


def test_from_pretrained_holds_only_the_packed_experts(model_dir):
    """No BF16 master: the experts' parameter and buffer bytes are the packed size, and the codes are the ones
    `fp4.quantize` gives the checkpoint's BF16 tensors (quantized as they loaded)."""
    model = load(model_dir)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    experts = fp4_experts(model)
    assert len(experts) == 2
    for m, layer in zip(experts, plain.model.layers, strict=True):
        assert m.frozen and not list(m.parameters())
        e, h, i = m.num_experts, m.hidden_dim, m.intermediate_dim
        packed = e * 2 * i * (h // 2 + h // 16) + e * h * (i // 2 + i // 16) + 2 * e * 4  # codes, E4M3, fp32 globals
        held = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
        assert held == packed == m.packed_nbytes()
        for q, w in zip(
            m.packed_weights(), (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj), strict=True
        ):
            ref = fp4.quantize(w.detach(), "nvfp4", scale="expert")
            assert torch.equal(q.packed, ref.packed) and torch.equal(q.block_scale, ref.block_scale)
            assert torch.equal(q.global_scale, ref.global_scale)
    # Every other weight loaded as in the plain model (nothing reported missing and left random).
    assert torch.equal(model.model.layers[1].self_attn.q_proj.weight, plain.model.layers[1].self_attn.q_proj.weight)
    # model.to(dtype) casts floating buffers; the FP4 global scales stay fp32.
    model.to(torch.bfloat16)
    assert all(m.down_proj_global_scale.dtype == torch.float32 and m.weight_dtype == torch.bfloat16 for m in experts)


def test_save_pretrained_round_trip(model_dir, tmp_path):
    """A frozen model's save_pretrained holds the packed codes (no BF16 experts) and reloads to the same logits."""
    from safetensors import safe_open

    model = load(model_dir).eval()
    model.save_pretrained(tmp_path / "frozen")
    with safe_open(str(tmp_path / "frozen" / "model.safetensors"), "pt") as f:
        held = sum(f.get_tensor(k).nbytes for k in f.keys() if ".experts." in k)  # noqa: SIM118
    assert held == sum(m.packed_nbytes() for m in fp4_experts(model))  # codes, E4M3 bytes, fp32 globals: no master
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "frozen", dtype=torch.float32).eval()
    assert all(m.frozen for m in fp4_experts(again))
    ids = torch.tensor(prompts(model.config.vocab_size, (6, 6)))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


@pytest.mark.parametrize("cache", [False, True])
def test_training_computes_from_the_rollout_weights(model_dir, cache):
    """The training forward of frozen experts uses the rollout's packed weights dequantized, bit for bit: the same
    output as the eval (rollout) path and as a QAT module quantized from the same masters; backward gives the input
    a gradient (the QAT module's, exactly) and the experts none."""
    frozen = fp4_experts(load(model_dir, cache_qat_weights=cache))[0]
    qat = fp4_experts(load(model_dir, freeze_experts=False))[0]
    for a, b in zip(frozen.packed_weights(), qat.packed_weights(), strict=True):
        assert torch.equal(a.dequantize(), b.dequantize())
    torch.manual_seed(0)
    x = torch.randn(12, frozen.hidden_dim)
    idx = torch.stack([torch.randperm(frozen.num_experts)[:2] for _ in range(12)])
    w = torch.softmax(torch.randn(12, 2), -1)
    frozen.eval()
    with torch.no_grad():
        rollout = frozen(x, idx, w)
    outs, grads = [], []
    for m in (frozen, qat):
        m.train()
        xi = x.clone().requires_grad_(True)
        y = m(xi, idx, w)
        y.square().sum().backward()
        outs.append(y.detach())
        grads.append(xi.grad)
    assert torch.equal(outs[0], rollout) and torch.equal(outs[0], outs[1])
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0
    assert qat.gate_up_proj.grad is not None and not list(frozen.parameters())


def test_contradictions_are_refused(model_dir, tmp_path):
    with pytest.raises(ValueError, match="qat=False"):
        TraceFP4Config(freeze_experts=True, qat=False)
    with pytest.raises(ValueError, match="freeze_experts"):
        TraceFP4Config(freeze_experts="yes")
    model = load(model_dir)
    m = fp4_experts(model)[0]
    opt = torch.optim.SGD([model.lm_head.weight, m.gate_up_proj_global_scale], lr=0.1)
    with pytest.raises(ValueError, match="frozen FP4 experts"):
        opt.step()
    with pytest.raises(ValueError, match="freeze_experts=True"):
        _trainer(model, tmp_path, peft_config=peft.LoraConfig(r=4, target_parameters=["mlp.experts.gate_up_proj"]))
    with pytest.raises(ValueError, match=r"name no module.*'q_proj'"):
        _trainer(model, tmp_path, peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "qkv_proj"]))


# ----------------------------------------------------------------------------------------------------------
# LoRA through the rollout engine
# ----------------------------------------------------------------------------------------------------------


def test_engine_folds_the_current_adapter(model_dir):
    """`generate` and the engine give the same greedy tokens with an adapter attached, and again after an optimizer
    step on it (the engine merges the adapter at every rollout); adapters it cannot fold are refused by name."""
    model = lora(load(model_dir)).eval()
    p = prompts(model.config.vocab_size)
    eng = make_rollout(model, "engine")
    assert isinstance(eng, EngineRollout)
    before = eng(model, p, greedy())
    assert before.completion_ids == GenerateRollout()(model, p, greedy()).completion_ids
    params = [q for n, q in model.named_parameters() if "lora_B" in n]
    opt = torch.optim.SGD(params, lr=1.0)
    for q in params:
        q.grad = torch.randn_like(q)
    opt.step()
    after = eng(model, p, greedy())
    assert after.completion_ids == GenerateRollout()(model, p, greedy()).completion_ids
    assert after.completion_ids != before.completion_ids
    head = peft.get_peft_model(load(model_dir), peft.LoraConfig(r=4, target_modules=["lm_head"])).eval()
    with pytest.raises(ValueError, match="lm_head.*not folded"):
        make_rollout(head, "engine")


def _trainer(model, tmp_path, peft_config=None, **kw):
    from datasets import Dataset

    from trace_hf import TraceGRPOConfig, TraceGRPOTrainer

    ds = Dataset.from_dict({"prompt": ["Q: 1+2\nA:", "Q: 3+3\nA:"]})
    args = TraceGRPOConfig(**{
        "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 2, "num_generations": 2,
        "max_completion_length": 8, "max_steps": 2, "learning_rate": 5e-2, "logging_steps": 1, "save_strategy": "no",
        "report_to": "none", "use_cpu": True, "bf16": False, "disable_tqdm": True, "rollout_engine": "engine",
        "seed": 0, **kw,
    })  # fmt: skip
    reward = lambda completions, **k: [float(sum(map(ord, c)) % 7) for c in completions]  # noqa: E731
    return TraceGRPOTrainer(model, reward, args=args, train_dataset=ds, processing_class=T.build_char_tokenizer(),
                            peft_config=peft_config)  # fmt: skip


def test_trainer_lora_with_frozen_experts_through_the_engine(model_dir, tmp_path):
    """GRPO with `peft_config` on frozen FP4 experts, rolled out by the engine: the adapter trains, the expert codes
    stay, every trace/* metric is logged, and engine and generate agree on greedy tokens before and after."""
    trainer = _trainer(
        load(model_dir), tmp_path, peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION)
    )
    model = trainer.model
    p = prompts(model.config.vocab_size, (5, 3))

    def agree():
        model.eval()
        a = EngineRollout()(model, p, greedy(max_new_tokens=4)).completion_ids
        assert a == GenerateRollout()(model, p, greedy(max_new_tokens=4)).completion_ids
        model.train()
        return a

    first = agree()
    lora_before = {n: q.detach().clone() for n, q in model.named_parameters() if "lora_" in n}
    codes = [b.clone() for m in fp4_experts(model) for b in m.buffers()]
    assert lora_before and all(q.requires_grad for n, q in model.named_parameters() if "lora_" in n)
    trainer.train()
    assert isinstance(trainer.rollout, EngineRollout)
    now = dict(model.named_parameters())
    assert any(not torch.equal(v, now[n]) for n, v in lora_before.items())
    assert all(torch.equal(a, b) for a, b in zip(codes, [b for m in fp4_experts(model) for b in m.buffers()]))
    logged = {k for h in trainer.state.log_history for k in h}
    for key in ("trace/hint_flip_rate", "trace/hint_flip_rate/experts_input", "trace/routing_mismatch",
                "trace/hint_coverage", "trace/hint_bytes_per_token", "trace/kl_rollout_train",
                "trace/rollout/seconds", "trace/rollout/tokens_per_second", "trace/train/hint_flip_rate",
                "trace/train/routing_mismatch", "sampling/importance_sampling_ratio/mean"):  # fmt: skip
        assert key in logged, key
    assert agree() != first  # the trained adapter changed the policy, and the engine saw it


def test_lora_on_the_router_trains_with_routing_replay(model_dir, tmp_path):
    """LoRA on the router (PEFT wraps its weight) rolls out through generate, keeps routing replay, and trains."""
    trainer = _trainer(
        load(model_dir), tmp_path, peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "gate"]),
        rollout_engine="generate", max_steps=1, max_completion_length=4,
    )  # fmt: skip
    model = trainer.model
    router = {n: q.detach().clone() for n, q in model.named_parameters() if "lora_" in n and ".gate." in n}
    assert router
    with pytest.raises(ValueError, match=r"mlp\.gate .*not folded"):
        make_rollout(model, "engine")
    trainer.train()
    now = dict(model.named_parameters())
    assert any(not torch.equal(v, now[n]) for n, v in router.items())
    assert any("trace/train/routing_mismatch" in h for h in trainer.state.log_history)


# ----------------------------------------------------------------------------------------------------------
# Save and load
# ----------------------------------------------------------------------------------------------------------


def test_adapter_and_merged_export_reload(model_dir, tmp_path):
    """The adapter through PEFT's save_pretrained, and the policy through export_fp4 with the adapter merged into
    the dense weights: both reload to the same logits."""
    from trace_hf.export import export_fp4, load_fp4

    model = lora(load(model_dir)).eval()
    ids = torch.tensor(prompts(model.config.vocab_size, (6, 6)))
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path / "adapter")
    again = peft.PeftModel.from_pretrained(load(model_dir), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, want)
    export_fp4(model, tmp_path / "export")
    assert any("lora_" in n for n, _ in model.named_parameters())  # the exported model keeps its adapter
    merged = load_fp4(tmp_path / "export", dtype=torch.float32)
    assert all(m.frozen for m in fp4_experts(merged)) and not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-5, atol=1e-5)
    assert isinstance(fp4_experts(merged)[0], TraceFP4Experts)


@pytest.mark.gpu
def test_frozen_experts_on_cuda_gpu(model_dir):
    """On the GPU (Triton dequantization, grouped GEMMs in bf16): the frozen training forward on the torch path
    equals the QAT one built from the same masters bit for bit, the input gradients agree, and the engine (CUDA
    graphs) with an adapter attached rolls out the tokens its eager steps give. (With the default kernel the
    training forward runs the rollout's kernels: tests/quant/test_frozen_kernel_training.py.)"""
    frozen = load(model_dir, torch.bfloat16, experts_kernel="torch").cuda()
    qat = load(model_dir, torch.bfloat16, freeze_experts=False).cuda()
    a, b = fp4_experts(frozen)[0], fp4_experts(qat)[0]
    for x, y in zip(a.packed_weights(), b.packed_weights(), strict=True):
        assert torch.equal(x.dequantize(torch.bfloat16), y.dequantize(torch.bfloat16))
    torch.manual_seed(0)
    x = torch.randn(512, a.hidden_dim, device="cuda", dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(a.num_experts, device="cuda")[:2] for _ in range(512)])
    w = torch.softmax(torch.randn(512, 2, device="cuda"), -1).to(torch.bfloat16)
    outs, grads = [], []
    for m in (a, b):
        m.train()
        xi = x.clone().requires_grad_(True)
        y = m(xi, idx, w)
        y.float().square().sum().backward()
        outs.append(y.detach())
        grads.append(xi.grad.float())
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(grads[0], grads[1], rtol=2e-2, atol=1e-3)
    model = lora(frozen).eval()
    p = prompts(model.config.vocab_size)
    graphs = EngineRollout()(model, p, greedy(max_new_tokens=8)).completion_ids
    eager = EngineRollout(use_graphs=False)(model, p, greedy(max_new_tokens=8)).completion_ids
    assert graphs == eager
