# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Bad input on the newer surfaces raises an error naming the field, file or tensor and the fix: the types of
TraceGRPOConfig's own fields, the export's calibration ids, a damaged compressed-tensors checkpoint, the targets of
a PeftModel handed to the trainer; and what the docs say matches what is accepted."""

import dataclasses
import logging

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file, save_file
from trl import GRPOConfig

from trace_hf import TraceFP4Config
from trace_hf import testing as T
from trace_hf.export import export_fp4, load_fp4
from trace_hf.quant.quantizer import quantize_model
from trace_hf.train import TraceGRPOConfig, TraceGRPOTrainer, grouping


def config(tmp_path, **kw):
    return TraceGRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", save_strategy="no", **kw
    )


# ----------------------------------------------------------------------------------------------------------
# TraceGRPOConfig: every field trace-hf adds is type-checked
# ----------------------------------------------------------------------------------------------------------

# Every bool field trace-hf adds to TRL's GRPOConfig, read off the dataclass: a new one is checked here unasked.
BOOL_FIELDS = sorted(
    {f.name for f in dataclasses.fields(TraceGRPOConfig) if f.type in ("bool", bool)}
    - {f.name for f in dataclasses.fields(GRPOConfig)}
)


@pytest.mark.parametrize("field", BOOL_FIELDS)
@pytest.mark.parametrize("value", ["false", "no", 0, None])
def test_bool_fields_refuse_strings_and_ints(tmp_path, field, value):
    """'false' is truthy: accepted, the option would stay on."""
    with pytest.raises(ValueError, match=rf"TraceGRPOConfig\.{field}={value!r}: give True or False"):
        config(tmp_path, **{field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("rollout_max_rows", "4"),
        ("rollout_max_rows", 2.5),
        ("rollout_max_rows", True),
        ("rollout_free_memory_fraction", "0.5"),
        ("rollout_free_memory_fraction", True),
        ("rollout_free_memory_fraction", None),
        ("rollout_importance_sampling_clip_max", "3"),
        ("rollout_importance_sampling_clip_max", True),
        ("rollout_importance_sampling_clip_min", "0.5"),
    ],
)
def test_numeric_fields_name_the_field(tmp_path, field, value):
    with pytest.raises(ValueError, match=rf"TraceGRPOConfig\.{field}={value!r}: give an? (int|number)"):
        config(tmp_path, **{field: value})


def test_numeric_fields_accept_ints_for_floats(tmp_path):
    c = config(
        tmp_path,
        rollout_max_rows=4,
        rollout_free_memory_fraction=1,
        rollout_importance_sampling_clip_max=3,
        rollout_importance_sampling_clip_min=None,
        rollout_compaction=False,
        rollout_share_prefill=False,
    )
    assert (c.rollout_max_rows, c.rollout_free_memory_fraction, c.rollout_compaction) == (4, 1, False)


# ----------------------------------------------------------------------------------------------------------
# Export: calibration ids, a damaged checkpoint, and how to load what was written
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp4_model():
    pytest.importorskip("compressed_tensors")
    return quantize_model(T.tiny_model(), TraceFP4Config())


def calib_ids(n=2, s=8):
    return torch.randint(4, 40, (n, s), generator=torch.Generator().manual_seed(0))


def test_calibration_ids_are_checked(fp4_model, tmp_path):
    vocab = fp4_model.get_input_embeddings().num_embeddings

    def export(calibration):
        export_fp4(fp4_model, tmp_path / "ct", format="compressed-tensors", calibration=calibration)

    with pytest.raises(TypeError, match=r"calibration batch 0 holds input_ids of dtype torch\.float32.*integer"):
        export(calib_ids().float())
    too_big = calib_ids()
    too_big[1, 3] = vocab
    with pytest.raises(ValueError, match=rf"calibration batch 1 holds token id {vocab} at row 1, position 3.*\[0, "):
        export([calib_ids(), too_big])
    with pytest.raises(ValueError, match="token id -1"):
        export(calib_ids() * 0 - 1)
    # Padding is embedded too, whatever its mask.
    padded = calib_ids()
    padded[0, -1] = 10**6
    with pytest.raises(ValueError, match="padding too"):
        export({"input_ids": padded, "attention_mask": (padded < vocab).long()})
    with pytest.raises(TypeError, match="input_ids is a list"):
        export({"input_ids": calib_ids().tolist()})
    assert not (tmp_path / "ct").exists()


def test_compressed_export_names_the_loader_that_reads_it(fp4_model, tmp_path, caplog):
    """transformers' own loader still scales NVFP4 MoE experts wrongly (the strict xfail in
    tests/export/test_export_compressed_tensors.py): the export says which loader to use."""
    with caplog.at_level(logging.WARNING):
        export_fp4(fp4_model, tmp_path / "ct", format="compressed-tensors", scheme="NVFP4A16")
    assert "trace_hf.export.load_fp4" in caplog.text and "huggingface/transformers#48371" in caplog.text


def test_damaged_expert_tensor_names_file_and_tensor(fp4_model, tmp_path):
    path = tmp_path / "ct"
    export_fp4(fp4_model, path, format="compressed-tensors", scheme="NVFP4A16")
    state = load_file(path / "model.safetensors")
    key = "model.layers.1.mlp.experts.3.up_proj.weight_packed"
    state[key] = state[key][:-1].contiguous()
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    want = rf"model\.safetensors holds {key} of shape \(31, 32\).*need shape \(32, 32\).*re-export"
    with pytest.raises(ValueError, match=want):
        load_fp4(path)


# ----------------------------------------------------------------------------------------------------------
# A PeftModel handed to the trainer gets the target check of peft_config=
# ----------------------------------------------------------------------------------------------------------


def test_peft_model_targets_are_checked(tmp_path):
    peft = pytest.importorskip("peft")
    ds = Dataset.from_dict({"prompt": ["Q: 1+2\nA:", "Q: 3+3\nA:"]})
    args = config(tmp_path, per_device_train_batch_size=2, num_generations=2, max_completion_length=4, max_steps=1)

    def trainer(targets):
        model = quantize_model(T.tiny_model(), TraceFP4Config())
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets))
        reward = lambda completions, **k: [0.0] * len(completions)  # noqa: E731
        return TraceGRPOTrainer(model, reward, args=args, train_dataset=ds, processing_class=T.build_char_tokenizer())

    with pytest.raises(ValueError, match=r"target_modules \['qkv_proj'\] name no module.*'q_proj'") as err:
        trainer(["q_proj", "qkv_proj"])
    assert "lora_A" not in str(err.value) and "base_layer" not in str(err.value)
    trainer(["q_proj", "v_proj"])


# ----------------------------------------------------------------------------------------------------------
# group_by_length: the module docstring says what the config accepts
# ----------------------------------------------------------------------------------------------------------


def test_grouping_docstring_matches_what_is_accepted(tmp_path):
    c = config(tmp_path, train_sampling_strategy="group_by_length", num_iterations=2, gradient_accumulation_steps=2)
    assert c.num_iterations == 2 and c.steps_per_generation == c.gradient_accumulation_steps
    doc = " ".join(grouping.__doc__.split())
    assert "one generation batch makes one optimizer step" not in doc
    assert "``num_iterations > 1`` keeps that, and is accepted" in doc
