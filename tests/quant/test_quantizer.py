# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""TraceFP4Config / TraceFP4HfQuantizer on the tiny Qwen3 MoE and Qwen3.5 MoE fixtures (CPU)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from trace_hf import TraceFP4Config, fp4
from trace_hf.export import export_fp4, load_fp4
from trace_hf.quant.experts import TraceFP4Experts, fp4_experts
from trace_hf.quant.kv_cache import FP4KVLayer, kv_bytes_per_token
from trace_hf.testing import save_tiny_model, tiny_config


FAMILIES = ["qwen3_moe", "qwen3_5_moe_text"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {f: save_tiny_model(root / f, family=f, dtype=torch.bfloat16) for f in FAMILIES}


def load(path, dtype=torch.float32, **cfg):
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=TraceFP4Config(**cfg), dtype=dtype)


def batch(n=2, s=12, vocab=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n, s), generator=g)


@pytest.mark.parametrize("family", FAMILIES)
def test_load_replaces_every_routed_experts_module(checkpoints, family):
    model = load(checkpoints[family])
    experts = fp4_experts(model)
    assert len(experts) == model.config.num_hidden_layers
    assert not any(
        type(m).__name__.endswith("Experts") and not isinstance(m, TraceFP4Experts) for m in model.modules()
    )
    # Default: the last half of the MoE layers record hints.
    assert [m.hinted for m in experts] == [False, False, True, True]
    # Other linears stay as they were.
    assert type(model.lm_head) is torch.nn.Linear
    assert model.config.quantization_config.quant_method == "trace_fp4"


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_and_train(checkpoints, family):
    model = load(checkpoints[family])
    ids = batch()
    model.eval()
    out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert out.sequences.shape == (2, 16)
    kinds = {type(layer).__name__ for layer in out.past_key_values.layers}
    assert "FP4KVLayer" in kinds
    if family == "qwen3_5_moe_text":  # hybrid: linear-attention layers keep their own cache layers
        assert "LinearAttentionLayer" in kinds

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = model(ids, labels=ids).loss
        loss.backward()
        grad = fp4_experts(model)[0].gate_up_proj.grad
        assert grad is not None and grad.abs().sum() > 0
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    print(f"{family} loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[-1] < losses[0] - 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_inference_and_training_paths_agree(checkpoints, family):
    model = load(checkpoints[family], dtype=torch.bfloat16)
    ids = batch()
    with torch.no_grad():
        model.eval()
        logits_eval = model(ids).logits.float()
        model.train()
        logits_train = model(ids).logits.float()
    # Same function on the same batch: the two paths are equal (one format definition, same compute order).
    assert torch.equal(logits_eval, logits_train)

    # Cached decode through the packed FP4 path against one full training forward on the same tokens.
    model.eval()
    out = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    decode = torch.stack(out.logits, 1).float()
    model.train()
    with torch.no_grad():
        full = model(out.sequences).logits[:, ids.shape[1] - 1 : -1].float()
    rel = ((decode - full).abs().max() / full.abs().max()).item()
    print(f"{family}: max relative |decode - full forward| = {rel:.4f}")
    assert rel < 0.1


def test_fp4_kv_cache_bytes_and_effect(checkpoints):
    path = checkpoints["qwen3_moe"]
    fp4_model, bf16_kv = load(path, kv_cache="nvfp4"), load(path, kv_cache=None)
    cfg = fp4_model.config
    ratio = kv_bytes_per_token(cfg, "nvfp4") / kv_bytes_per_token(cfg, None)
    print(
        f"FP4 KV bytes/token {kv_bytes_per_token(cfg, 'nvfp4')} vs BF16 {kv_bytes_per_token(cfg, None)}: {ratio:.3f}x"
    )
    d = cfg.head_dim  # per token and head: D/2 code bytes + D/16 scale bytes + a 4-byte row scale, vs 2D
    assert ratio == pytest.approx((d / 2 + d / 16 + 4) / (2 * d))
    big = tiny_config("qwen3_moe", head_dim=128)
    assert kv_bytes_per_token(big, "nvfp4") / kv_bytes_per_token(big, None) < 0.3
    ids = batch()
    for m in (fp4_model, bf16_kv):
        m.eval()
    with torch.no_grad():
        a, b = fp4_model(ids).logits, bf16_kv(ids).logits
    rel = ((a - b).abs().max() / b.abs().max()).item()
    print(f"logits with FP4 KV vs BF16 KV: max relative difference {rel:.4f}")
    assert 0 < rel < 0.25
    out = fp4_model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    layer = out.past_key_values.layers[0]
    assert isinstance(layer, FP4KVLayer) and layer.keys.dtype == torch.uint8


def test_packed_expert_bytes(checkpoints):
    model = load(checkpoints["qwen3_moe"], dtype=torch.bfloat16)
    experts = fp4_experts(model)
    packed = sum(m.packed_nbytes() for m in experts)
    bf16 = sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in experts) * 2
    print(f"packed experts {packed} B vs BF16 {bf16} B: {packed / bf16:.3f}x")
    assert packed <= 0.3 * bf16


@pytest.mark.parametrize("optimizer", ["sgd", "adamw_fused"])
def test_packed_weights_follow_optimizer_steps(checkpoints, optimizer):
    model = load(checkpoints["qwen3_moe"])
    m = fp4_experts(model)[0]
    before = m.packed_weights()[0].packed.clone()
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
    else:  # fused kernels update parameters without bumping their version counters
        opt = torch.optim.AdamW(model.parameters(), lr=1e-1, fused=True)
    model.train()
    model(batch(), labels=batch()).loss.backward()
    opt.step()
    after = m.packed_weights()[0].packed
    assert not torch.equal(before, after)
    assert torch.equal(after, fp4.quantize(m.gate_up_proj.detach(), m.fmt, "expert").packed)


def test_save_and_reload_roundtrip(checkpoints, tmp_path):
    model = load(checkpoints["qwen3_5_moe_text"], fmt="mxfp4", hint_layers=1)
    model.save_pretrained(tmp_path / "q")
    saved = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "trace_fp4" and saved["fmt"] == "mxfp4" and saved["hint_layers"] == 1
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32)
    assert isinstance(again.config.quantization_config, TraceFP4Config)
    assert [m.hinted for m in fp4_experts(again)] == [False, False, False, True]
    ids = batch()
    for m in (model, again):
        m.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)


def test_export_packed_and_load_back(checkpoints, tmp_path):
    model = load(checkpoints["qwen3_moe"], dtype=torch.bfloat16)
    sizes = export_fp4(model, tmp_path / "export")
    bf16_experts = sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in fp4_experts(model)) * 2
    assert sizes["experts"] <= 0.3 * bf16_experts
    again = load_fp4(tmp_path / "export", dtype=torch.bfloat16)
    ids = batch()
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
    for a, b in zip(fp4_experts(model), fp4_experts(again)):
        assert torch.equal(a.packed_weights()[0].packed, b.packed_weights()[0].packed)


def test_config_round_trips_and_validation(tmp_path):
    cfg = TraceFP4Config(fmt="mxfp4", activations="fp4", kv_cache=None, hint_layers=3, modules_to_not_convert=["x"])
    assert TraceFP4Config.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    cfg.to_json_file(tmp_path / "q.json")
    assert TraceFP4Config.from_dict(json.loads((tmp_path / "q.json").read_text())).to_dict() == cfg.to_dict()
    opted = TraceFP4Config(prefill_bf16_gemms=True)
    assert TraceFP4Config.from_dict(opted.to_dict()).prefill_bf16_gemms is True
    with pytest.raises(ValueError, match="prefill_bf16_gemms"):
        TraceFP4Config(prefill_bf16_gemms="yes")
    with pytest.raises(ValueError, match="nvfp4"):
        TraceFP4Config(fmt="fp8")
    with pytest.raises(ValueError, match="W4A16"):
        TraceFP4Config(activations="int4")
    with pytest.raises(ValueError, match="kv_cache"):
        TraceFP4Config(kv_cache="int8")
    with pytest.raises(ValueError, match="hint_layers"):
        TraceFP4Config(hint_layers=-1)
    with pytest.raises(ValueError, match="experts_input"):
        TraceFP4Config(hint_sites=["attention"])
    with pytest.raises(ValueError, match="activations='fp4'"):
        TraceFP4Config(activations="none", hint_layers=2)
    with pytest.raises(ValueError, match="experts_kernel"):
        TraceFP4Config(experts_kernel="cuda")
    with pytest.raises(ValueError, match="experts_kernel='torch'"):
        TraceFP4Config(fmt="mxfp4", experts_kernel="triton")
    with pytest.raises(ValueError, match="cache_qat_weights"):
        TraceFP4Config(cache_qat_weights="yes")
    with pytest.raises(ValueError, match="Unknown"):
        TraceFP4Config(bogus=1)


def test_too_many_hint_layers_and_unsupported_models(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="at most 4"):
        load(checkpoints["qwen3_moe"], hint_layers=9)
    from transformers import Qwen3Config

    dense = AutoModelForCausalLM.from_config(
        Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    )
    dense.save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match="no fused routed-experts"):
        load(tmp_path / "dense")


def test_modules_to_not_convert_and_w4a16(checkpoints):
    model = load(
        checkpoints["qwen3_moe"],
        modules_to_not_convert=["model.layers.0.mlp.experts"],
        activations="none",
        hint_layers=0,
    )
    assert not isinstance(model.model.layers[0].mlp.experts, TraceFP4Experts)
    assert all(isinstance(model.model.layers[i].mlp.experts, TraceFP4Experts) for i in (1, 2, 3))
    model.eval()
    assert model.generate(batch(), max_new_tokens=2, do_sample=False).shape == (2, 14)


def test_gradient_checkpointing_gives_the_same_gradients(checkpoints):
    ids = batch()
    grads = []
    for ckpt in (False, True):
        model = load(checkpoints["qwen3_moe"])
        model.train()
        if ckpt:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model(ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.equal(grads[0], grads[1])


def test_uncached_qat_weights_give_the_same_loss_and_gradients(checkpoints):
    ids = batch()
    results = []
    for cache in (True, False):
        model = load(checkpoints["qwen3_moe"], cache_qat_weights=cache)
        model.train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        kept = [m.weight_store.dequantized is not None for m in fp4_experts(model)]
        assert all(kept) if cache else not any(kept)  # no extra copy of the weights without the cache
        results.append(
            (loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        )
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_trainer_accepts_the_model_for_full_finetuning(checkpoints, tmp_path):
    model = load(checkpoints["qwen3_moe"])
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    Trainer(model=model, args=args)  # raises for quantized models unless is_trainable and is_qat_trainable


def test_qat_off_trains_in_the_model_dtype_but_rolls_out_in_fp4(checkpoints):
    path = checkpoints["qwen3_moe"]
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    naive = load(path, qat=False)
    ids = batch()
    with torch.no_grad():
        plain.train()
        naive.train()
        assert torch.allclose(plain(ids).logits, naive(ids).logits, atol=1e-5)  # no fake quantization in training
        naive.eval()
        assert not torch.allclose(plain(ids).logits, naive(ids).logits, atol=1e-3)  # FP4 rollout path
    assert TraceFP4Config.from_dict(TraceFP4Config(qat=False).to_dict()).qat is False
