# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""TRL's GRPOConfig options with TraceGRPOTrainer: each works (a short run on the tiny model) or is refused at
construction with an error that names the field and the alternative; and config defaults that warn about nothing."""

import warnings
from unittest.mock import patch

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from transformers.generation.utils import GenerationMixin

from trace_hf import TraceFP4Config, TraceGRPOConfig, TraceGRPOTrainer
from trace_hf import data as D
from trace_hf import testing as T


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return T.save_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def dataset():
    rows = [(a, b) for a in range(4) for b in range(4)]
    return Dataset.from_dict(
        {"prompt": [D.format_prompt(f"{a}+{b}") for a, b in rows], "answer": [f"#### {a + b}" for a, b in rows]}
    )


def varied_reward(completions, **kwargs):
    return [float(sum(map(ord, c)) % 7) / 7 for c in completions]


def config(tmp_path, **kw):
    """Two steps, 4 completions of up to 8 tokens per step: each case runs in about a second on CPU."""
    base = {
        "output_dir": str(tmp_path), "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8,
        "max_steps": 2, "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no", "report_to": "none", "seed": 0, "bf16": False,
        "use_cpu": True, "dataloader_pin_memory": False, "disable_tqdm": True, "activation_checkpointing": False,
    }  # fmt: skip
    return TraceGRPOConfig(**{**base, **kw})


def train(model_dir, dataset, args):
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, quantization_config=TraceFP4Config(hint_layers=4)
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = TraceGRPOTrainer(
        model, varied_reward, args=args, train_dataset=dataset, processing_class=T.build_char_tokenizer()
    )
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    return trainer, changed


# GRPOConfig fields that touch generation or the loss, and a setting away from TRL's default: each trains with hints,
# routing replay and the IS correction (docs/api.md lists them).
WORKS = {
    "loss_type=grpo": {"loss_type": "grpo"},
    "loss_type=bnpo": {"loss_type": "bnpo"},
    "loss_type=dr_grpo": {"loss_type": "dr_grpo"},
    "loss_type=cispo": {"loss_type": "cispo"},
    "loss_type=sapo": {"loss_type": "sapo"},
    "loss_type=vespo": {"loss_type": "vespo"},
    "loss_type=luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "importance_sampling_level=sequence (GSPO)": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    "num_iterations=2": {"num_iterations": 2},
    "steps_per_generation=2": {"steps_per_generation": 2},
    "scale_rewards=batch": {"scale_rewards": "batch"},
    "scale_rewards=none": {"scale_rewards": "none"},
    "reward_weights=[0.5]": {"reward_weights": [0.5]},
    "top_entropy_quantile=0.5": {"top_entropy_quantile": 0.5},
    "entropy_coef=0.01": {"entropy_coef": 0.01},
    "use_adaptive_entropy": {"use_adaptive_entropy": True},
    "mask_truncated_completions": {"mask_truncated_completions": True},
    "delta=2.0": {"delta": 2.0},
    "epsilon_high=0.28": {"epsilon_high": 0.28},
    "beta=0.04 (reference model)": {"beta": 0.04},
    "beta + sync_ref_model": {"beta": 0.04, "sync_ref_model": True, "ref_model_sync_steps": 1},
    "beta + use_bias_correction_kl=False": {"beta": 0.04, "use_bias_correction_kl": False},
    "off_policy_mask_threshold=0.5": {"off_policy_mask_threshold": 0.5},
    "cast_lm_head_to_fp32": {"cast_lm_head_to_fp32": True},
    "generation_kwargs={top_k: 5}": {"generation_kwargs": {"top_k": 5}},
    "top_k, top_p, min_p, repetition_penalty": {"top_k": 5, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1},
    "cache_implementation=static": {"cache_implementation": "static"},
    "router_aux_loss_coef=0.01": {"router_aux_loss_coef": 0.01},
    "disable_dropout": {"disable_dropout": True},
}


@pytest.mark.parametrize("name", list(WORKS))
def test_grpo_option_trains_with_hints(model_dir, dataset, tmp_path, name):
    trainer, changed = train(model_dir, dataset, config(tmp_path, **WORKS[name]))
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(h["loss"] == h["loss"] for h in logs)  # finite
    assert any("trace/hint_flip_rate" in h for h in logs)  # hints were recorded and applied
    assert changed, "no parameter changed"


REFUSED = {
    "use_liger_kernel": {"use_liger_kernel": True},
    "use_transformers_paged": {"use_transformers_paged": True},
    "use_transformers_continuous_batching": {"use_transformers_continuous_batching": True},
    "use_vllm": {"use_vllm": True},
    "vllm_mode": {"vllm_mode": "server"},
    "vllm_gpu_memory_utilization": {"vllm_gpu_memory_utilization": 0.5},
    "rollout_importance_sampling_mode": {"vllm_importance_sampling_mode": "token_truncate"},
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_option_is_refused_at_config_time_naming_the_field(tmp_path, name):
    with pytest.raises(ValueError, match=name):
        config(tmp_path, **REFUSED[name])


def test_mask_truncated_completions_the_trl_way(model_dir, dataset, tmp_path):
    """TRL's test_train_with_mask_truncated_completions, on the TRACE trainer. TRL mocks `generate` with a function
    that never runs the model; a TRACE rollout records hints and the sampler's log-probs from the model's own
    forwards, so nothing would be recorded ("HintRecorder recorded nothing"). Here the real generate runs, forced to
    TRL's three cases (truncated, EOS inside, EOS on the last allowed token), and truncated rows leave the loss."""
    eos = 3
    forced = [
        [5, 6, 7, 8, 9, 10, 11, 12],  # truncated
        [13, 14, 15, eos],  # ends with EOS
        [16, 17, 18, 19, 20, 21, 22, eos],  # EOS just within the limit
        [23, 24, 25, 26, 27, 28, 29, 30],  # truncated
    ]
    real_generate = GenerationMixin.generate

    def forced_generate(self, input_ids=None, **kwargs):
        start = input_ids.shape[1]

        def allowed(row, ids):
            step, want = ids.shape[0] - start, forced[row % len(forced)]
            return [want[step] if step < len(want) else eos]

        return real_generate(self, input_ids=input_ids, prefix_allowed_tokens_fn=allowed, **kwargs)

    masks = []
    args = config(tmp_path, mask_truncated_completions=True, loss_type="dapo", learning_rate=0.1)
    with patch.object(GenerationMixin, "generate", forced_generate):
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, quantization_config=TraceFP4Config(hint_layers=4)
        )
        trainer = TraceGRPOTrainer(
            model, varied_reward, args=args, train_dataset=dataset, processing_class=T.build_char_tokenizer()
        )
        score = trainer._generate_and_score_completions

        def spy(inputs):
            out = score(inputs)
            masks.append((out["completion_ids"].clone(), out["completion_mask"].sum(1)))
            return out

        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        with patch.object(trainer, "_generate_and_score_completions", spy):
            trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters())
    for ids, kept in masks:
        for row, n in zip(ids.tolist(), kept.tolist(), strict=True):
            ends = eos in row[:8]
            assert n == (row.index(eos) + 1 if ends else 0), (row, n)  # truncated rows are masked whole


# 5. Config defaults
# ----------------------------------------------------------------------------------------------------------


def _config_warnings(**kwargs):
    from trace_hf import TraceGRPOConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = TraceGRPOConfig(output_dir="x", report_to="none", use_cpu=True, **kwargs)
    return config, [str(w.message) for w in caught]


def test_plain_config_warns_about_nothing_checkpointing():
    config, caught = _config_warnings()
    assert not [m for m in caught if "checkpointing" in m], caught
    assert config.activation_checkpointing is True  # TRL's default (memory for large models), now without a warning


@pytest.mark.parametrize("on", [True, False])
def test_explicit_gradient_checkpointing_still_works(on):
    """transformers 5 renamed it to activation_checkpointing; a user passing the old name still gets it (and the
    deprecation warning transformers gives for the old name)."""
    config, caught = _config_warnings(gradient_checkpointing=on)
    assert config.activation_checkpointing is on
    assert any("gradient_checkpointing" in m for m in caught), caught


@pytest.mark.parametrize("on", [True, False])
def test_activation_checkpointing_warns_about_nothing(on):
    config, caught = _config_warnings(activation_checkpointing=on)
    assert config.activation_checkpointing is on
    assert not [m for m in caught if "checkpointing" in m], caught
