# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""export_fp4(format="compressed-tensors") and load_fp4 of such a checkpoint, read back with compressed-tensors' own
classes and transformers' compressed-tensors integration (CPU, tiny models)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM


pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import generate_gparam  # noqa: E402

from trace_hf import HintRecorder, TraceFP4Config, fp4  # noqa: E402
from trace_hf.export import export_fp4, load_fp4  # noqa: E402
from trace_hf.export.compressed import trace_global_scale, weight_global_scale  # noqa: E402
from trace_hf.quant.experts import fp4_experts  # noqa: E402
from trace_hf.testing import build_char_tokenizer, save_tiny_model  # noqa: E402


W4A16 = {"activations": "none", "kv_cache": None, "hint_layers": 0}


def calib(seed=0, n=3, s=10):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 40, (n, s), generator=g)


def load(path, **cfg):
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=TraceFP4Config(**cfg), dtype=torch.bfloat16)


def with_edges(model):
    """Layer 0's experts at the edges: expert 0 all zero, expert 1 with huge weights (large global scale), expert 2
    with gate rows 1e-5 of its amax (subnormal E4M3 block scales)."""
    m = fp4_experts(model)[0]
    with torch.no_grad():
        m.gate_up_proj[0].zero_()
        m.down_proj[0].zero_()
        m.gate_up_proj[1].mul_(3e4)
        m.gate_up_proj[2, : m.intermediate_dim].mul_(1e-5)
    return model


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("src") / "qwen3_moe", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory):
    """A W4A4 export (calibrated) of the tiny model with edge experts, and the model."""
    model = with_edges(load(source))
    path = tmp_path_factory.mktemp("ct") / "export"
    export_fp4(model, path, format="compressed-tensors", calibration=calib(), tokenizer=build_char_tokenizer())
    return model, path


def ct_scheme(path):
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    return QuantizationConfig.model_validate(qc).config_groups["group_0"]


def expert_names(layer, e):
    base = f"model.layers.{layer}.mlp.experts.{e}"
    return {"gate": f"{base}.gate_proj", "up": f"{base}.up_proj", "down": f"{base}.down_proj"}


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The BF16 spacing at |x| (fp32 x; 0 at 0: zeros must be exact). |x| in [2^(e-1), 2^e) has spacing 2^(e-8)."""
    _, e = torch.frexp(x.float())
    return torch.where(
        x == 0, torch.zeros_like(x, dtype=torch.float32), torch.ldexp(torch.ones_like(x.float()), e - 8)
    )


def read_back(model, path) -> dict[str, int]:
    """Every expert and projection of `path`, read with compressed-tensors' own unpacking and NVFP4 compressor,
    against `model`'s packed FP4 weights; returns how many edge cases it met."""
    state, scheme = load_file(path / "model.safetensors"), ct_scheme(path)
    compressor = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized")
    edges = {"zero": 0, "largest_scale": 0, "subnormal": 0}
    for layer, m in enumerate(fp4_experts(model)):
        gu, d = m.packed_weights()
        i = m.intermediate_dim
        for e in range(m.num_experts):
            names = expert_names(layer, e)
            for proj, q, rows in (("gate", gu, slice(0, i)), ("up", gu, slice(i, 2 * i)), ("down", d, slice(None))):
                sd = {f: state[f"{names[proj]}.{f}"] for f in ("weight_packed", "weight_scale", "weight_global_scale")}
                codes = fp4.unpack_codes(q.packed[e, rows])
                # compressed-tensors' unpacking gives the same E2M1 values, signed zeros included
                values = unpack_fp4_from_uint8(sd["weight_packed"], *codes.shape, dtype=torch.float32)
                ref = fp4.e2m1_decode(codes)
                assert torch.equal(values, ref) and torch.equal(values.signbit(), ref.signbit())
                scale_bytes = sd["weight_scale"].view(torch.uint8)
                assert torch.equal(scale_bytes, q.block_scale[e, rows])
                g = q.global_scale[e].reshape(1)
                assert torch.equal(sd["weight_global_scale"], weight_global_scale(g))
                dense = compressor.decompress(sd, scheme)["weight"]
                want = fp4.FP4Tensor(q.packed[e, rows], q.block_scale[e, rows], g.reshape(1, 1)).dequantize()
                # compressed-tensors divides by the fp32 reciprocal: within one BF16 ulp of the exact value
                assert dense.dtype == torch.bfloat16
                assert ((dense.float() - want).abs() <= bf16_ulp(want)).all()
                edges["zero"] += int(not want.any())
                edges["largest_scale"] += int((scale_bytes == 0x7E).any())
                edges["subnormal"] += int(((scale_bytes & 0x78) == 0)[scale_bytes > 0].any())
    return edges


def test_experts_read_back_with_compressed_tensors_bit_for_bit(exported):
    edges = read_back(*exported)
    g = fp4_experts(exported[0])[0].packed_weights()[0].global_scale.flatten()
    assert g[1] > 1e3 * g[3]  # the huge expert's global scale went through too
    assert edges["zero"] == 3 and edges["subnormal"] >= 1 and edges["largest_scale"] >= 2 * (4 * 8 - 1)


def test_qwen3_5_moe_experts_read_back(tmp_path):
    """The hybrid family: per-expert names under model.layers (its converter), read back bit for bit too."""
    model = load(save_tiny_model(tmp_path / "src", family="qwen3_5_moe_text", dtype=torch.bfloat16), **W4A16)
    export_fp4(model, tmp_path / "ct", format="compressed-tensors", scheme="NVFP4A16")
    read_back(model, tmp_path / "ct")
    ignore = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["ignore"]
    assert {"model.layers.0.linear_attn.in_proj_qkv", "model.layers.1.mlp.shared_expert.up_proj"} <= set(ignore)


def test_calibration_from_recorded_rollouts(source, tmp_path):
    """A HintBatch of recorded rollouts calibrates on the tokens the rollout fed (prompt and completion, not the
    last sampled token, which no forward saw)."""
    model = load(source)
    model.eval()
    prompts = calib(2, n=2, s=6)
    with HintRecorder(model) as rec:
        seq = model.generate(prompts, attention_mask=torch.ones_like(prompts), min_new_tokens=4, max_new_tokens=4)
    hints = rec.collect(torch.ones_like(seq))
    assert hints.lengths.tolist() == [9, 9] and torch.equal(hints.token_ids.long(), seq[:, :9])
    export_fp4(model, tmp_path / "a", format="compressed-tensors", calibration=hints)
    export_fp4(model, tmp_path / "b", format="compressed-tensors", calibration=seq[:, :9])
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_quantization_config_is_compressed_tensors_nvfp4(exported):
    model, path = exported
    config = json.loads((path / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    assert qc["quantization_status"] == "compressed"
    group = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    preset = preset_name_to_scheme("NVFP4", ["Linear"])
    assert group.targets == ["Linear"]
    assert group.weights == preset.weights and group.input_activations == preset.input_activations
    ignore = set(qc["ignore"])
    assert "lm_head" in ignore and not any(".experts." in n for n in ignore)
    for layer in range(4):
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate"):
            assert f"model.layers.{layer}.{n}" in ignore
    assert config["dtype"] == "bfloat16"
    for f in ("tokenizer.json", "generation_config.json"):
        assert (path / f).is_file()
    state = load_file(path / "model.safetensors")
    dense = {k: v for k, v in state.items() if ".experts." not in k}
    assert all(v.dtype == torch.bfloat16 for v in dense.values())
    assert torch.equal(dense["model.layers.0.self_attn.q_proj.weight"], model.model.layers[0].self_attn.q_proj.weight)


def test_input_global_scales_are_calibrated(exported, source):
    """gate/up: 448 * 6 over the largest |x| entering the layer's experts over the calibration tokens (seen here
    at the post-attention norm's output); padding does not count."""
    model, path = exported
    state = load_file(path / "model.safetensors")
    seen = {}
    hooks = [
        layer.post_attention_layernorm.register_forward_hook(
            lambda mod, a, out, i=i: seen.__setitem__(i, max(seen.get(i, 0.0), float(out.float().abs().amax())))
        )
        for i, layer in enumerate(model.model.layers)
    ]
    model.eval()
    with torch.no_grad():
        model(calib(), use_cache=False)
    for h in hooks:
        h.remove()
    for layer in range(4):
        want = generate_gparam(torch.tensor(-seen[layer]), torch.tensor(seen[layer]))
        for e in range(8):
            names = expert_names(layer, e)
            assert torch.equal(state[f"{names['gate']}.input_global_scale"], want)
            assert torch.equal(state[f"{names['up']}.input_global_scale"], want)
            down = state[f"{names['down']}.input_global_scale"]
            assert torch.isfinite(down).all() and down.item() > 0
    # The same tokens, right-padded with garbage under a zero attention mask, calibrate to the same scales.
    ids = calib()
    padded = torch.cat([ids, torch.full((3, 5), 7)], dim=1)
    mask = torch.cat([torch.ones_like(ids), torch.zeros(3, 5, dtype=ids.dtype)], dim=1)
    other = path.parent / "padded"
    export_fp4(model, other, format="compressed-tensors", calibration=[{"input_ids": padded, "attention_mask": mask}])
    again = load_file(other / "model.safetensors")
    assert all(torch.equal(again[k], v) for k, v in state.items() if k.endswith("input_global_scale"))


def test_reciprocal_global_scale_round_trips():
    g = torch.rand(20000) * 10.0 ** torch.randint(-12, 6, (20000,)).float()
    G = weight_global_scale(g)
    assert torch.equal(weight_global_scale(trace_global_scale(G)), G)
    assert torch.equal(weight_global_scale(torch.zeros(1)), torch.ones(1))  # compressed-tensors' empty-tensor value


def test_round_trip_export_load_export_is_identical(exported, tmp_path):
    """Loaded as frozen packed experts (the pairing for RL from a published checkpoint), the checkpoint's FP4 weights
    are the model's, bit for bit, and exporting again writes the same files."""
    model, path = exported
    again = load_fp4(path, quantization_config=TraceFP4Config(freeze_experts=True), dtype=torch.bfloat16)
    for a, b in zip(fp4_experts(model), fp4_experts(again)):
        for x, y in zip(a.packed_weights(), b.packed_weights()):
            assert torch.equal(x.packed, y.packed) and torch.equal(x.block_scale, y.block_scale)
    export_fp4(again, tmp_path / "again", format="compressed-tensors", calibration=calib(), tokenizer=None)
    first, second = load_file(path / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert first.keys() == second.keys()
    weights = [k for k in first if not k.endswith("input_global_scale")]
    assert all(torch.equal(first[k].view(torch.uint8), second[k].view(torch.uint8)) for k in weights)
    # The calibrated activation scales come from a forward (frozen experts compute it from the packed weights, the
    # source model from its masters), where a last-bit difference can route a token elsewhere: not compared.
    assert json.loads((path / "config.json").read_text()) == json.loads((tmp_path / "again/config.json").read_text())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_default_mode_load_computes_with_the_checkpoint_and_says_when_masters_differ(exported, dtype, caplog):
    """Default mode (trainable masters): the loaded model computes with the checkpoint's FP4 weights, bit for bit, and
    where no masters re-quantize to them (the checkpoint stores the global scale's reciprocal, and not every fp32
    global scale is amax / 2688 of some master) the load warns, naming freeze_experts, instead of drifting silently."""
    _, path = exported
    ref = load_fp4(path, quantization_config=TraceFP4Config(freeze_experts=True), dtype=dtype)
    with caplog.at_level("WARNING"):
        model = load_fp4(path, quantization_config=TraceFP4Config(), dtype=dtype)
    drifted = False
    for m, f in zip(fp4_experts(model), fp4_experts(ref)):
        assert m.gate_up_proj.dtype == dtype
        for master, q, want in zip((m.gate_up_proj, m.down_proj), m.packed_weights(), f.packed_weights()):
            assert torch.equal(q.packed, want.packed) and torch.equal(q.block_scale, want.block_scale)
            assert torch.equal(q.global_scale, want.global_scale)
            r = fp4.quantize(master.detach(), "nvfp4", scale="expert")
            drifted |= not (torch.equal(r.packed, want.packed) and torch.equal(r.block_scale, want.block_scale))
    assert drifted == ("freeze_experts=True" in caplog.text)


def test_w4a16_logits_through_compressed_tensors_decompression(tmp_path, source):
    """The served model in W4A16: a plain transformers model whose experts are compressed-tensors' decompression
    of the checkpoint gives the trained model's logits (FP4 weights, BF16 activations)."""
    model = load(source, **W4A16)
    export_fp4(model, tmp_path / "w4a16", format="compressed-tensors", scheme="NVFP4A16")
    path = tmp_path / "w4a16"
    state, scheme = load_file(path / "model.safetensors"), ct_scheme(path)
    assert scheme.input_activations is None and not any(k.endswith("input_global_scale") for k in state)
    compressor = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized")
    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    served = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    dense = {k: v for k, v in state.items() if ".experts." not in k}
    served.load_state_dict(dense, strict=False)
    for layer, block in enumerate(served.model.layers):
        w = {}
        for e in range(8):
            for proj, name in expert_names(layer, e).items():
                sd = {f: state[f"{name}.{f}"] for f in ("weight_packed", "weight_scale", "weight_global_scale")}
                w[proj, e] = compressor.decompress(sd, scheme)["weight"]
        with torch.no_grad():
            block.mlp.experts.gate_up_proj.copy_(
                torch.stack([torch.cat([w["gate", e], w["up", e]]) for e in range(8)])
            )
            block.mlp.experts.down_proj.copy_(torch.stack([w["down", e] for e in range(8)]))
    ids = calib(1)
    model.eval()
    with torch.no_grad():
        want, got = model(ids).logits.float(), served(ids).logits.float()
    # BF16 activations on both sides, expert weights within one BF16 ulp: BF16 rounding of the sums (measured: 2
    # BF16 ulps of the largest logit, 0.0078 of 0.61).
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    # trace-hf itself loads it back to the same logits, exactly.
    again = load_fp4(path, quantization_config=TraceFP4Config(**W4A16), dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_transformers_from_pretrained_loads_the_export(exported):
    """transformers' compressed-tensors integration loads the checkpoint (on CPU, dequantizing while loading); the
    dense weights are the export's."""
    model, path = exported
    served = AutoModelForCausalLM.from_pretrained(path)
    assert served.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 64, 64)
    assert torch.equal(served.lm_head.weight, model.lm_head.weight)
    assert torch.equal(served.model.layers[1].self_attn.o_proj.weight, model.model.layers[1].self_attn.o_proj.weight)


@pytest.mark.xfail(
    strict=True,
    reason="transformers (up to at least 5.25.0) dequantizes NVFP4 MoE experts without weight_global_scale "
    "(huggingface/transformers#48371, fix in #48372): its experts come back scaled by 448*6/amax",
)
def test_transformers_from_pretrained_experts_equal_the_fp4_weights(exported):
    model, path = exported
    served = AutoModelForCausalLM.from_pretrained(path)
    for m, block in zip(fp4_experts(model), served.model.layers):
        want = m.packed_weights()[0].dequantize()
        got = block.mlp.experts.gate_up_proj.float()
        assert ((got - want).abs() <= bf16_ulp(want)).all()


# ----------------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------------


def test_bad_input_names_the_fix(source, exported, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="TraceFP4Config"):
        export_fp4(AutoModelForCausalLM.from_pretrained(source), tmp_path / "a", format="compressed-tensors")
    with pytest.raises(ValueError, match="fmt='nvfp4'"):
        export_fp4(load(source, fmt="mxfp4", kv_cache=None), tmp_path / "b", format="compressed-tensors")
    model, path = exported
    with pytest.raises(ValueError, match="scheme='NVFP4A16'"):
        export_fp4(model, tmp_path / "c", format="compressed-tensors")
    with pytest.raises(ValueError, match="NVFP4A16"):
        export_fp4(model, tmp_path / "d", format="compressed-tensors", scheme="W4A16")
    with pytest.raises(ValueError, match="'trace_fp4' or 'compressed-tensors'"):
        export_fp4(model, tmp_path / "e", format="nvfp4")
    with pytest.raises(TypeError, match="compressed-tensors"):
        export_fp4(model, tmp_path / "f", calibration=calib())
    with pytest.raises(ValueError, match="fmt='nvfp4'"):
        load_fp4(path, quantization_config=TraceFP4Config(fmt="mxfp4"))
    # A family whose original checkpoints store the experts fused (no per-expert conversion to revert).
    import transformers.core_model_loading as core

    monkeypatch.setattr(core, "revert_weight_conversion", lambda model, state: state)
    with pytest.raises(ValueError, match="format='trace_fp4'"):
        export_fp4(model, tmp_path / "g", format="compressed-tensors", scheme="NVFP4A16")


def test_from_pretrained_refuses_a_second_quantization_config(exported):
    """Why load_fp4 builds the model itself: transformers raises when config.json names compressed-tensors and
    another quantization config class is passed."""
    _, path = exported
    with pytest.raises(
        ValueError, match="quantized with CompressedTensorsConfig but you are passing a TraceFP4Config"
    ):
        AutoModelForCausalLM.from_pretrained(path, quantization_config=TraceFP4Config())


def test_load_refuses_other_compressed_tensors_formats(exported, tmp_path):
    _, path = exported
    other = tmp_path / "int4"
    other.mkdir()
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["format"] = "pack-quantized"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="NVFP4"):
        load_fp4(other)


def test_load_sharded_checkpoint_with_nvfp4_attention(exported, tmp_path):
    """llm-compressor's checkpoints: sharded, and attention Linears in NVFP4 too (decompressed on load with
    compressed-tensors' compressor)."""
    model, path = exported
    state = load_file(path / "model.safetensors")
    q_proj = "model.layers.0.self_attn.q_proj"
    q = fp4.quantize(state.pop(f"{q_proj}.weight").float(), "nvfp4", scale="tensor")
    state[f"{q_proj}.weight_packed"] = q.packed
    state[f"{q_proj}.weight_scale"] = q.block_scale.view(torch.float8_e4m3fn)
    state[f"{q_proj}.weight_global_scale"] = weight_global_scale(q.global_scale.reshape(1))
    out = tmp_path / "sharded"
    out.mkdir()
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in shards.items():
        save_file({k: state[k] for k in part}, out / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["ignore"].remove(q_proj)
    (out / "config.json").write_text(json.dumps(config))
    again = load_fp4(out, quantization_config=TraceFP4Config(), dtype=torch.bfloat16)
    sd = {f: state[f"{q_proj}.{f}"] for f in ("weight_packed", "weight_scale", "weight_global_scale")}
    want = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized").decompress(sd, ct_scheme(path))["weight"]
    assert torch.equal(again.model.layers[0].self_attn.q_proj.weight, want.to(torch.bfloat16))
    assert torch.equal(again.model.layers[1].self_attn.q_proj.weight, model.model.layers[1].self_attn.q_proj.weight)
    for a, b in zip(fp4_experts(model), fp4_experts(again)):
        assert all(torch.equal(x.packed, y.packed) for x, y in zip(a.packed_weights(), b.packed_weights()))


def test_load_keeps_scales_no_master_reproduces(exported, tmp_path):
    """A block whose largest code is 0.5 under a normal scale (trace-hf's quantizer never writes one; another
    quantizer may): no master re-quantizes to it, and the model still computes with the checkpoint's codes."""
    _, path = exported
    state = load_file(path / "model.safetensors")
    name = "model.layers.2.mlp.experts.5.down_proj"
    packed = state[f"{name}.weight_packed"].clone()
    packed[0, :8] = 0x11  # the first block of row 0: every code 0.5
    state[f"{name}.weight_packed"] = packed
    (tmp_path / "odd").mkdir()
    save_file(state, tmp_path / "odd" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "odd" / "config.json").write_text((path / "config.json").read_text())
    model = load_fp4(tmp_path / "odd", quantization_config=TraceFP4Config(), dtype=torch.bfloat16)
    d = fp4_experts(model)[2].packed_weights()[1]
    assert torch.equal(d.packed[5], packed)
    assert torch.equal(d.block_scale[5].view(torch.float8_e4m3fn), state[f"{name}.weight_scale"])
    assert not torch.equal(fp4.quantize(fp4_experts(model)[2].down_proj.detach(), scale="expert").packed[5], packed)
