# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Bad input does the right thing or raises an error naming the fix: quantizer inputs and hints, the config,
load-time refusals, and the integrity of an FP4 export."""

import json
import shutil
import struct

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trace_hf import TraceFP4Config, fp4
from trace_hf.export import export_fp4, load_fp4
from trace_hf.export.trace_fp4 import EXPERTS_FILE
from trace_hf.quant.experts import fp4_experts
from trace_hf.quant.quantizer import quantize_model
from trace_hf.testing import save_tiny_model, tiny_model


BACKENDS = ["torch", "triton"]


def rows(n=4, k=64, seed=0, dtype=torch.float32):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ----------------------------------------------------------------------------------------------------------
# Quantizer inputs
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_integer_and_bool_tensors_are_refused(backend, dtype):
    x = (rows() * 4).to(dtype)
    with pytest.raises(TypeError, match=r"x\.float\(\)"):
        fp4.fake_quantize(x, backend=backend)
    with pytest.raises(TypeError, match="floating-point"):
        fp4.quantize(x, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_float64_beyond_float32_range(backend, fmt):
    x = rows(dtype=torch.float64)
    # Inside the fp32 range float64 quantizes exactly as its fp32 rounding does.
    ref = fp4.quantize(x.float(), fmt, backend="torch")
    q = fp4.quantize(x, fmt, backend=backend)
    assert torch.equal(q.packed, ref.packed) and torch.equal(q.block_scale, ref.block_scale)
    # A finite value that fp32 cannot hold used to turn its whole row into NaN.
    x[1, 3] = 1e39
    with pytest.raises(ValueError, match="clamp it to torch.finfo"):
        fp4.quantize(x, fmt, backend=backend)
    with pytest.raises(ValueError, match="float32 range"):
        fp4.fake_quantize(x, fmt, backend=backend)
    # Non-finite values keep the documented policy: they poison their group, no error.
    x[1, 3] = float("inf")
    assert fp4.fake_quantize(x, fmt, backend=backend)[1].isnan().any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_mode_is_checked_for_mxfp4_too(backend):
    x = rows()
    with pytest.raises(ValueError, match="scale mode"):
        fp4.quantize(x, "mxfp4", scale="block", backend=backend)
    with pytest.raises(ValueError, match="scale mode"):
        fp4.fake_quantize(x, "mxfp4", scale="per_channel", backend=backend)
    with pytest.raises(ValueError, match="leading expert dimension"):
        fp4.quantize(x[0], "mxfp4", scale="expert", backend=backend)
    # MXFP4 has per-block scales only: every valid mode gives the same codes (as documented).
    w = rows(8, 64).view(2, 4, 64)
    r = fp4.quantize(w, "mxfp4", "row", backend=backend)
    for scale in ("tensor", "expert"):
        q = fp4.quantize(w, "mxfp4", scale, backend=backend)
        assert torch.equal(q.packed, r.packed) and torch.equal(q.block_scale, r.block_scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fake_quantize_format_must_match_hints(backend):
    x = rows()
    hints = fp4.extract_hints(fp4.quantize(x, "mxfp4", backend="torch"))
    with pytest.raises(ValueError, match="pass fmt='mxfp4'"):
        fp4.fake_quantize(x, "nvfp4", hints=hints, backend=backend)
    # Without fmt, the hints' format is used.
    y = fp4.fake_quantize(x * 1.01, hints=hints, backend=backend)
    assert torch.equal(y, fp4.guided_quantize(x * 1.01, hints, backend="torch").dequantize())


@pytest.mark.parametrize("backend", BACKENDS)
def test_malformed_hints_are_refused(backend):
    x = rows(4, 64)  # 4 rows and 4 NVFP4 blocks per row: a [rows] global scale would broadcast over blocks
    h = fp4.extract_hints(fp4.quantize(x, backend="torch"))
    short = fp4.FP4Hints(h.mantissa_bits, h.block_scale[:, :1], h.global_scale)
    with pytest.raises(ValueError, match="block_scale has shape"):
        fp4.guided_quantize(x, short, backend=backend)
    flat_g = fp4.FP4Hints(h.mantissa_bits, h.block_scale, h.global_scale.reshape(-1))
    with pytest.raises(ValueError, match=r"global_scale has shape \(4,\).*unsqueeze"):
        fp4.guided_quantize(x, flat_g, backend=backend)
    with pytest.raises(ValueError, match="global_scale"):
        fp4.fake_quantize(x, hints=flat_g, backend=backend)
    for field in ("mantissa_bits", "block_scale"):
        bad = fp4.FP4Hints(**{**vars(h), field: getattr(h, field).float()})
        with pytest.raises(TypeError, match=f"{field} must be the raw uint8"):
            fp4.guided_quantize(x, bad, backend=backend)
    with pytest.raises(TypeError, match="global_scale must be float32"):
        fp4.guided_quantize(x, fp4.FP4Hints(h.mantissa_bits, h.block_scale, h.global_scale.double()), backend=backend)
    # Well-formed hints with a shared (tensor) global scale still work.
    ht = fp4.extract_hints(fp4.quantize(x, scale="tensor", backend="torch"))
    assert torch.equal(fp4.guided_quantize(x, ht, backend=backend).packed, fp4.quantize(x, scale="tensor").packed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fake", [False, True])
def test_hinted_quantize_needs_a_bool_flag_per_row(backend, fake):
    x = rows(4, 64)
    h = fp4.extract_hints(fp4.quantize(x, backend="torch"))
    call = fp4.hinted_fake_quantize if fake else fp4.hinted_quantize
    for has in (torch.ones(4, 1, dtype=torch.bool), torch.ones(3, dtype=torch.bool), torch.ones(4)):
        with pytest.raises(ValueError, match=r"has must be a bool flag per row of x, shape \(4,\)"):
            call(x, h, has, backend=backend)
    with pytest.raises(ValueError, match="block_scale has shape"):
        call(x, fp4.FP4Hints(h.mantissa_bits, h.block_scale[:, :1], h.global_scale), torch.ones(4, dtype=torch.bool),
             backend=backend)  # fmt: skip
    _, flips = call(x, h, torch.ones(4, dtype=torch.bool), backend=backend)
    assert int(flips) == 0  # the hints of x itself: nothing to correct


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_last_dimension(backend):
    x = torch.zeros(3, 0)
    with pytest.raises(ValueError, match="non-zero multiple of 16"):
        fp4.quantize(x, backend=backend)
    with pytest.raises(ValueError, match="non-zero multiple of 32"):
        fp4.fake_quantize(x, "mxfp4", backend=backend)
    # Empty leading dimensions are fine.
    assert fp4.fake_quantize(torch.zeros(0, 32), backend=backend).shape == (0, 32)


# ----------------------------------------------------------------------------------------------------------
# Config and load-time checks
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [True, False, 1.0, "2", -1])
def test_hint_layers_must_be_a_non_negative_int(value):
    with pytest.raises(ValueError, match="not a bool"):
        TraceFP4Config(hint_layers=value)
    assert TraceFP4Config(hint_layers=0).hint_layers == 0


def test_modules_to_not_convert_must_match_a_module():
    with pytest.raises(ValueError, match=r"match no module.*model\.layers\.0\.mlp\.experts"):
        quantize_model(tiny_model(), TraceFP4Config(modules_to_not_convert=["model.layers.0.mlp.expert"]))
    model = quantize_model(tiny_model(), TraceFP4Config(modules_to_not_convert=["model.layers.0.mlp.experts"]))
    assert len(fp4_experts(model)) == model.config.num_hidden_layers - 1


def test_dequantize_message_names_the_fix(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(
        save_tiny_model(tmp_path / "base"), quantization_config=TraceFP4Config()
    )
    model.save_pretrained(tmp_path / "q")
    with pytest.raises(NotImplementedError, match="del config.quantization_config") as err:
        model.dequantize()
    assert "config.json still applies FP4" in str(err.value)
    # The fix it names gives the plain model.
    config = AutoConfig.from_pretrained(tmp_path / "q")
    del config.quantization_config
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "q", config=config)
    assert not fp4_experts(plain) and not hasattr(plain.config, "quantization_config")


def tiny_deepseek_v3(**overrides):
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0, kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, max_position_embeddings=128, num_mtp_layers=0,
    )  # fmt: skip
    config.update(overrides)
    return AutoModelForCausalLM.from_config(config)


def test_mla_with_fp4_kv_cache_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"MLA attention.*kv_cache=None"):
        quantize_model(tiny_deepseek_v3(), TraceFP4Config())
    # Also through from_pretrained.
    tiny_deepseek_v3().save_pretrained(tmp_path / "ds")
    with pytest.raises(ValueError, match=r"MLA attention.*kv_cache=None"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "ds", quantization_config=TraceFP4Config())


def test_routers_that_are_not_softmax_top_k_are_refused():
    with pytest.raises(ValueError, match=r"not softmax top-k.*routed_scaling_factor=2\.5.*Supported are qwen3_moe"):
        quantize_model(tiny_deepseek_v3(), TraceFP4Config(kv_cache=None))
    # Sigmoid scoring is refused even with a neutral scaling factor and one group.
    with pytest.raises(ValueError, match="DeepseekV3TopkRouter"):
        quantize_model(tiny_deepseek_v3(routed_scaling_factor=1.0, n_group=1), TraceFP4Config(kv_cache=None))
    # Config-level markers of other routing rules (remote-code DeepSeek configs carry these).
    model = tiny_model()
    model.config.scoring_func = "sigmoid"
    with pytest.raises(ValueError, match="scoring_func='sigmoid'"):
        quantize_model(model, TraceFP4Config())
    model = tiny_model()
    model.config.topk_method = "noaux_tc"
    with pytest.raises(ValueError, match="topk_method='noaux_tc'"):
        quantize_model(model, TraceFP4Config())


# ----------------------------------------------------------------------------------------------------------
# Export integrity
# ----------------------------------------------------------------------------------------------------------


def ids_batch():
    return torch.randint(4, 40, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Two exports of one architecture (different weights) and the first model's logits."""
    root = tmp_path_factory.mktemp("export")
    out = {}
    for seed in (0, 1):
        model = tiny_model(seed=seed)
        quantize_model(model, TraceFP4Config())
        export_fp4(model, root / f"e{seed}")
        if seed == 0:
            with torch.no_grad():
                out["logits"] = model.eval()(ids_batch()).logits
    out["dirs"] = [root / "e0", root / "e1"]
    return out


def copy_export(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_export_round_trip_is_exact(exported):
    again = load_fp4(exported["dirs"][0])
    with torch.no_grad():
        assert torch.equal(again(ids_batch()).logits, exported["logits"])


def test_flipped_bytes_in_experts_file_are_detected(exported, tmp_path):
    d = copy_export(exported["dirs"][0], tmp_path / "flipped")
    path = d / EXPERTS_FILE
    raw = bytearray(path.read_bytes())
    data_start = 8 + struct.unpack("<Q", raw[:8])[0]
    raw[data_start + 100] ^= 0x10  # one bit of one packed code byte
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"corrupted.*SHA-256.*copy the file again"):
        load_fp4(d)


def test_experts_file_of_another_model_is_detected(exported, tmp_path):
    d = copy_export(exported["dirs"][0], tmp_path / "mixed")
    shutil.copy(exported["dirs"][1] / EXPERTS_FILE, d / EXPERTS_FILE)
    with pytest.raises(ValueError, match="copy both files"):
        load_fp4(d)


def edit_config(d, edit):
    path = d / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def test_config_edited_to_another_format_is_detected(exported, tmp_path):
    d = copy_export(exported["dirs"][0], tmp_path / "fmt")
    edit_config(d, lambda c: c["quantization_config"].update(fmt="mxfp4"))
    with pytest.raises(ValueError, match=r"fmt='mxfp4'.*set quantization_config.fmt='nvfp4'"):
        load_fp4(d)
    edit_config(d, lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match="no trace_fp4 quantization_config"):
        load_fp4(d)


def test_another_expert_width_is_a_clear_error(exported, tmp_path):
    d = copy_export(exported["dirs"][0], tmp_path / "width")
    edit_config(d, lambda c: c.update(moe_intermediate_size=64))
    with pytest.raises(ValueError, match=r"moe_intermediate_size: exported 32, now 64.*restore config.json"):
        load_fp4(d)
    # The same check when the config is passed in instead.
    config = AutoConfig.from_pretrained(exported["dirs"][0])
    config.moe_intermediate_size = 64
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        load_fp4(exported["dirs"][0], config=config)


def test_tied_embeddings_export_round_trip(tmp_path):
    model = quantize_model(tiny_model(tie_word_embeddings=True), TraceFP4Config())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    export_fp4(model, tmp_path / "tied")
    again = load_fp4(tmp_path / "tied")
    assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()
    ids = ids_batch()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model.eval()(ids).logits)
