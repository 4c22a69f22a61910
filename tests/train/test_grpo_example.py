# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""examples/grpo.py: regimes side by side, TensorBoard offline, runs never overwritten, the CPU mismatch."""

import glob
import importlib.util
import json
import os
import sys

import pytest
import torch
from accelerate import PartialState

from trace_hf import testing as T


PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def grpo():
    spec = importlib.util.spec_from_file_location("grpo_example", os.path.join(PROJECT_ROOT, "examples", "grpo.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and TRL's parser resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


def test_regimes_take_all_or_a_list_and_every_trl_field_is_a_flag(grpo):
    script, config, model_args = grpo.parse_args([])
    assert script.regimes == ["bf16", "naive", "fp4", "trace"]
    assert (config.max_steps, config.num_generations, config.report_to, model_args.dtype) == (40, 8, [], "bfloat16")
    assert config.activation_checkpointing is False and model_args.model_name_or_path is None
    script, config, model_args = grpo.parse_args(
        ["--regimes", "trace,bf16,trace", "--rollout-engine", "generate", "--report_to", "tensorboard,wandb"]
        + ["--learning_rate", "1e-5", "--num_generations", "4", "--per_device_train_batch_size", "8"]
        + ["--rollout_importance_sampling", "false", "--use_peft", "--lora_target_modules", "q_proj", "v_proj"]
    )
    assert script.regimes == ["trace", "bf16"] and config.rollout_engine == "generate"
    assert config.report_to == ["tensorboard", "wandb"]
    assert (config.learning_rate, config.num_generations, config.per_device_train_batch_size) == (1e-5, 4, 8)
    assert config.rollout_importance_sampling is False
    assert model_args.use_peft and model_args.lora_target_modules == ["q_proj", "v_proj"]
    with pytest.raises(SystemExit):
        grpo.parse_args(["--regimes", "fp4,fp8"])


def test_the_qwen3_30b_recipe_parses_into_the_config(grpo):
    """The recipe beside the example: every key is a known flag, and flags after --config override it."""
    recipe = os.path.join(PROJECT_ROOT, "examples", "recipes", "qwen3_30b_a3b_grpo.yaml")
    script, config, model_args = grpo.parse_args(["--config", recipe, "--max_steps", "3"])
    assert script.regimes == ["fp4", "trace"] and script.dataset_name == "openai/gsm8k"
    assert (model_args.model_name_or_path, model_args.dtype) == ("Qwen/Qwen3-30B-A3B", "bfloat16")
    assert config.bf16 and config.activation_checkpointing and not config.gradient_checkpointing_kwargs
    assert (config.loss_type, config.num_generations, config.max_completion_length) == ("dapo", 8, 1024)
    assert config.mask_truncated_completions and config.beta == 0.0 and config.epsilon_high == 0.28
    assert config.rollout_importance_sampling and config.rollout_importance_sampling_mode == "token_truncate"
    assert config.max_steps == 3 and config.learning_rate == 1e-6 and config.report_to == ["tensorboard"]


def test_the_one_gpu_lora_recipe_freezes_the_experts_and_refuses_naive(grpo):
    """The full-size one-GPU recipe: frozen FP4 experts, LoRA r=32 on q/k/v/o, 256 rows a step; the naive regime,
    which trains the BF16 expert masters that frozen experts do not keep, is refused naming the fix."""
    recipe = os.path.join(PROJECT_ROOT, "examples", "recipes", "qwen3_30b_a3b_lora_1gpu.yaml")
    script, config, model_args = grpo.parse_args(["--config", recipe])
    assert script.freeze_experts and script.regimes == ["trace"] and config.rollout_compaction
    assert model_args.use_peft and (model_args.lora_r, model_args.lora_alpha) == (32, 64)
    assert model_args.lora_target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert config.per_device_train_batch_size * config.gradient_accumulation_steps == 256
    with pytest.raises(SystemExit):
        grpo.parse_args(["--config", recipe, "--regimes", "naive,trace"])
    assert grpo.parse_args(["--config", recipe, "--regimes", "all"])[0].regimes == ["bf16", "fp4", "trace"]


def test_the_qwen35_one_gpu_lora_recipe_targets_what_the_engine_folds(grpo):
    """The Qwen3.5-35B-A3B one-GPU recipe: frozen FP4 experts, LoRA r=32 on exactly the linears the hybrid engine
    folds (so a LoRA run rolls out through the engine, not generate), 256 rows a step."""
    from trace_hf.rollout.engine import LORA_TARGETS

    recipe = os.path.join(PROJECT_ROOT, "examples", "recipes", "qwen35_35b_a3b_lora_1gpu.yaml")
    script, config, model_args = grpo.parse_args(["--config", recipe, "--max_steps", "3"])
    assert script.freeze_experts and script.regimes == ["trace"] and config.rollout_compaction
    assert (model_args.model_name_or_path, model_args.dtype) == ("Qwen/Qwen3.5-35B-A3B", "bfloat16")
    assert model_args.use_peft and (model_args.lora_r, model_args.lora_alpha) == (32, 64)
    assert sorted(model_args.lora_target_modules) == sorted(t.rsplit(".", 1)[-1] for t in LORA_TARGETS["qwen3_5_moe"])
    assert config.per_device_train_batch_size * config.gradient_accumulation_steps == 256
    assert config.gated_delta_rule == "auto" and config.max_steps == 3


def test_frozen_experts_with_lora_train_only_the_adapter(grpo, tmp_path):
    """--freeze_experts --use_peft on the tiny offline model: the FP4 regime's experts are packed FP4 with no
    parameters, the BF16 regime's have no gradients, and what trains is the adapter."""
    from trace_hf.quant.experts import fp4_experts, is_fused_experts

    path = T.save_tiny_model(tmp_path / "tiny")
    argv = ["--freeze_experts", "--use_peft", "--lora_target_modules", "q_proj", "v_proj", "--output_dir",
            str(tmp_path / "out"), "--per_device_train_batch_size", "8", "--num_generations", "4"]  # fmt: skip
    script, _, model_args = grpo.parse_args(argv)
    data = grpo.load_dataset(script.dataset_name, 0)
    for regime in ("trace", "bf16"):
        args = grpo.regime_config(argv, regime, str(tmp_path / "out" / regime))
        trainer = grpo.build_trainer(script, args, model_args, regime, path, data, None)
        trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n in trainable), trainable
        experts = fp4_experts(trainer.model)
        if regime == "trace":
            assert experts and all(m.frozen and not list(m.parameters()) for m in experts)
        else:
            fused = [m for m in trainer.model.modules() if is_fused_experts(m)]
            assert not experts and fused and not any(p.requires_grad for m in fused for p in m.parameters())


def test_a_model_from_the_command_line_trains(grpo, tmp_path):
    """``--model_name_or_path`` (what a user with a checkpoint types): the model is loaded from there, with no SFT
    warm-up, and the regime trains and reports."""
    path = T.save_tiny_model(tmp_path / "my-moe")
    out = grpo.main(
        ["--model_name_or_path", path, "--regimes", "trace", "--output_dir", str(tmp_path / "out"), "--run_name", "r"]
        + ["--max_steps", "1", "--per_device_train_batch_size", "4", "--num_generations", "4"]
        + ["--max_completion_length", "3"]
    )
    assert [r["regime"] for r in out["regimes"]] == ["trace"] and out["regimes"][0]["steps"] == 1
    assert not os.path.exists(tmp_path / "out" / "sft-warm")
    with open(os.path.join(out["run_dir"], "summary.json")) as f:
        assert json.load(f)["args"]["model"]["model_name_or_path"] == path


def test_a_checkpoint_the_fp4_regimes_cannot_run_is_refused_before_any_regime(grpo, tmp_path):
    """A dense checkpoint, or a folder without tokenizer files, stops the run with the fix named before the BF16
    regime spends its time; the BF16 regime alone still runs a dense model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = T.build_char_tokenizer()
    dense = str(tmp_path / "dense")
    Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=len(tok))).save_pretrained(dense)  # fmt: skip
    tok.save_pretrained(dense)
    base = ["--output_dir", str(tmp_path / "out"), "--max_steps", "1", "--per_device_train_batch_size", "4",
            "--num_generations", "4", "--max_completion_length", "2"]  # fmt: skip
    with pytest.raises(SystemExit, match=r"Qwen2ForCausalLM .*no fused routed experts.*--regimes bf16"):
        grpo.main(["--model_name_or_path", dense, "--run_name", "dense"] + base)
    assert not os.path.exists(tmp_path / "out" / "dense" / "bf16")  # refused before the first regime
    out = grpo.main(["--model_name_or_path", dense, "--regimes", "bf16", "--run_name", "dense_bf16"] + base)
    assert out["regimes"][0]["steps"] == 1

    bare = T.save_tiny_model(tmp_path / "bare")
    for name in os.listdir(bare):
        if name.startswith(("tokenizer", "special_tokens")):
            os.remove(os.path.join(bare, name))
    with pytest.raises(SystemExit, match=r"encodes the prompt .* to no tokens.*tokenizer.save_pretrained"):
        grpo.main(["--model_name_or_path", bare, "--run_name", "bare"] + base)


@pytest.mark.parametrize("fmt", ["trace_fp4", "compressed-tensors"])
def test_the_exported_policy_computes_as_the_trained_one(grpo, tmp_path, fmt):
    """--export_fp4 (`export_policy`): the trained policy, LoRA merged, loads back with load_fp4, with its tokenizer,
    and gives the trained model's logits bit for bit (frozen FP4 experts, bf16 dense weights, in either format)."""
    from transformers import AutoTokenizer

    from trace_hf.export import load_fp4

    path = T.save_tiny_model(tmp_path / "m", dtype=torch.bfloat16)
    argv = ["--model_name_or_path", path, "--freeze_experts", "--use_peft", "--lora_target_modules", "q_proj",
            "v_proj", "--learning_rate", "0.05", "--output_dir", str(tmp_path / "out"), "--max_steps", "1",
            "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "3"]  # fmt: skip
    script, _, model_args = grpo.parse_args(argv + ["--export_fp4", fmt])
    data = grpo.load_dataset(script.dataset_name, 0)
    args = grpo.regime_config(argv, "trace", str(tmp_path / "out" / "trace"))
    trainer = grpo.build_trainer(script, args, model_args, "trace", path, data, None)
    trainer.train()
    grpo.export_policy(trainer, str(tmp_path / "policy"), fmt, data)
    trained = trainer.model.merge_and_unload().eval()
    policy = load_fp4(str(tmp_path / "policy"), dtype=torch.bfloat16).eval()
    ids = torch.tensor([[5, 17, 9, 30, 4, 11]])
    with torch.no_grad():
        want, got = trained(ids).logits.float(), policy(ids).logits.float()
    assert torch.equal(got, want), (got - want).abs().max()  # the untrained model is 0.7 away here
    assert AutoTokenizer.from_pretrained(str(tmp_path / "policy"))("1+2")["input_ids"]


def test_export_runs_after_each_fp4_regime_only(grpo, tmp_path):
    path = T.save_tiny_model(tmp_path / "m")
    out = grpo.main(
        ["--model_name_or_path", path, "--regimes", "bf16,trace", "--export_fp4", "trace_fp4", "--output_dir",
         str(tmp_path / "out"), "--run_name", "r", "--max_steps", "1", "--per_device_train_batch_size", "4",
         "--num_generations", "4", "--max_completion_length", "2"]
    )  # fmt: skip
    assert os.path.exists(os.path.join(out["run_dir"], "trace", "policy", "config.json"))
    assert not os.path.exists(os.path.join(out["run_dir"], "bf16", "policy"))


def test_an_existing_run_is_refused_without_overwrite(grpo, tmp_path):
    run = grpo.prepare_run_dir(str(tmp_path), "r", False, PartialState())
    open(os.path.join(run, "table.md"), "w").close()
    with pytest.raises(SystemExit, match="--overwrite"):
        grpo.prepare_run_dir(str(tmp_path), "r", False, PartialState())
    assert os.path.exists(os.path.join(run, "table.md"))
    assert grpo.prepare_run_dir(str(tmp_path), "r", True, PartialState()) == run and os.listdir(run) == []
    assert grpo.prepare_run_dir(str(tmp_path), None, False, PartialState()) != run  # default: the start time


def test_split_attention_is_the_same_math_and_rounds_differently_in_bf16(grpo):
    """The CPU default's mismatch: eager attention in eval (rollout), SDPA in training. In fp32 both agree (so the
    mask handling is right: causal, left padding); in BF16 they differ by rounding, which is what FP4 amplifies."""
    attn = grpo.register_split_attention()
    tok = T.build_char_tokenizer()
    batch = tok(["Q: 3+4\nA: 7", "Q: 12+30\nA: 42"], return_tensors="pt", padding=True)
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    real = batch.attention_mask.bool()

    def logits(dtype, training):
        model = T.tiny_model(tokenizer=tok, dtype=dtype, attn_implementation=attn)
        model.train(training)
        with torch.no_grad():
            return model(**batch, position_ids=positions).logits.float()[real]

    torch.testing.assert_close(logits(torch.float32, False), logits(torch.float32, True), rtol=1e-5, atol=1e-5)
    diff = (logits(torch.bfloat16, False) - logits(torch.bfloat16, True)).abs().max()
    assert 0 < diff < 0.1


def test_regimes_share_a_start_and_report_one_table_plot_and_tensorboard(grpo, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = grpo.main(
        ["--regimes", "bf16,trace", "--output_dir", str(tmp_path), "--run_name", "r", "--max_steps", "2"]
        + ["--sft_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4"]
        + ["--max_completion_length", "3", "--report_to", "tensorboard"]
    )
    run = out["run_dir"]
    bf16, trace = out["regimes"]
    assert (bf16["regime"], trace["regime"]) == ("bf16", "trace") and bf16["steps"] == trace["steps"] == 2
    assert len(os.listdir(os.path.join(tmp_path, "sft-warm"))) == 1  # one warm start for both
    with open(os.path.join(run, "trace", "metrics.json")) as f:
        history = json.load(f)
    assert [h["step"] for h in history if "reward" in h] == [1, 2]
    # Only the FP4 regime measures FP4 mismatch.
    assert "routing" in trace and "routing" not in bf16
    with open(os.path.join(run, "table.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) == 4 and "TRACE" in lines[3] and "n/a" in lines[2]
    assert os.path.getsize(os.path.join(run, "grpo.png")) > 10_000
    events = glob.glob(os.path.join(run, "trace", "runs", "*", "events.out.tfevents.*"))
    assert events, os.listdir(os.path.join(run, "trace"))
    acc = EventAccumulator(os.path.dirname(events[0]))
    acc.Reload()
    assert len(acc.Scalars("train/reward")) == 2
    assert any(tag.startswith("train/trace/") for tag in acc.Tags()["scalars"])
