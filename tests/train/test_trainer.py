# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""TraceGRPOTrainer on the tiny Qwen3 MoE: config checks, hints on/off, packed-weight refresh, IS ratio, PEFT."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from trace_hf import TraceFP4Config, fp4
from trace_hf import data as D
from trace_hf import testing as T
from trace_hf.quant.experts import fp4_experts
from trace_hf.train import TraceGRPOConfig, TraceGRPOTrainer, importance_sampling_ratio


METRICS = (
    "trace/hint_flip_rate",
    "trace/routing_mismatch",
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "trace/kl_rollout_train",
    "trace/hint_bytes_per_token",
    "sampling/importance_sampling_ratio/mean",
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return T.save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3_moe")


@pytest.fixture(scope="module")
def dataset():
    rows = [(a, b) for a in range(4) for b in range(4)]
    return Dataset.from_dict(
        {"prompt": [D.format_prompt(f"{a}+{b}") for a, b in rows], "answer": [f"#### {a + b}" for a, b in rows]}
    )


def load(path, dtype=torch.float32, **quant):
    quant = {"hint_layers": 4, **quant}  # every MoE layer hinted
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=TraceFP4Config(**quant))


def perturb_rollout(model, scale=1e-2, seed=0):
    """Stand in for the rollout kernels' own rounding: small noise on the MoE blocks' input in eval mode only.

    On CPU the rollout and training forwards are often bit-identical (fp32, or bf16 GEMMs that happen to pick the
    same blocking), so there would be no mismatch to correct. This noise moves some experts-input values across
    FP4 rounding boundaries and some routing decisions, exactly what hints and routing replay record and undo.
    """
    gen = torch.Generator().manual_seed(seed)

    def hook(module, args, output):
        if module.training:
            return output
        noise = torch.randn(output.shape, generator=gen).to(output.dtype)
        return output * (1 + scale * noise)

    for layer in model.model.layers:
        layer.post_attention_layernorm.register_forward_hook(hook)
    return model


def config(tmp_path, **kw):
    base = {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,  # steps_per_generation=2: rows are shuffled and split across micro-steps
        "num_generations": 4,
        "max_completion_length": 6,
        "max_steps": 2,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "seed": 0,
        "bf16": False,
        "use_cpu": True,
        "dataloader_pin_memory": False,
        "disable_tqdm": True,
    }
    base.update(kw)
    return TraceGRPOConfig(**base)


def varied_reward(completions, **kwargs):
    """A reward that differs within every group, so the random tiny model gets a policy gradient everywhere (with
    the arithmetic reward it scores 0 throughout and only the router aux loss would train anything)."""
    return [float(sum(map(ord, c)) % 7) / 7 for c in completions]


def make(model, tmp_path, dataset, peft_config=None, **kw):
    return TraceGRPOTrainer(
        model,
        [D.arithmetic_reward, varied_reward],
        args=config(tmp_path, **kw),
        train_dataset=dataset,
        processing_class=T.build_char_tokenizer(),
        peft_config=peft_config,
    )


def history(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


# ----------------------------------------------------------------------------------------------------------
# Config and model checks
# ----------------------------------------------------------------------------------------------------------


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="use_vllm"):
        config(tmp_path, use_vllm=True)
    with pytest.raises(ValueError, match="rollout_importance_sampling_mode"):
        config(tmp_path, rollout_importance_sampling_mode="token")
    with pytest.raises(ValueError, match="trace_hints=False and routing_replay=False"):
        config(tmp_path, rollout_precision="bf16")
    with pytest.raises(ValueError, match="rollout_precision"):
        config(tmp_path, rollout_precision="fp8")
    with pytest.raises(ValueError, match="trace_hint_storage"):
        config(tmp_path, trace_hint_storage="disk")
    with pytest.raises(ValueError, match="clip_min"):
        config(tmp_path, rollout_importance_sampling_clip_min=4.0)
    # TRL's vLLM correction fields are never silently ignored: they name their counterparts here.
    with pytest.raises(ValueError, match="rollout_importance_sampling_mode"):
        config(tmp_path, vllm_importance_sampling_mode="token_truncate")
    with pytest.raises(ValueError, match="rollout_importance_sampling_clip_max"):
        config(tmp_path, vllm_importance_sampling_clip_max=5.0)
    with pytest.raises(ValueError, match="rollout_engine"):
        config(tmp_path, rollout_engine="vllm")


def test_trainer_refuses_mismatched_models(tmp_path, model_dir, dataset):
    plain = AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(ValueError, match="TraceFP4Config"):
        make(plain, tmp_path, dataset)
    with pytest.raises(ValueError, match="no hinted MoE layers"):
        make(load(model_dir, hint_layers=0), tmp_path, dataset)
    with pytest.raises(ValueError, match="unquantized baseline"):
        make(load(model_dir), tmp_path, dataset, rollout_precision="bf16", trace_hints=False, routing_replay=False)
    from trl import GRPOConfig

    with pytest.raises(TypeError, match="TraceGRPOConfig"):
        TraceGRPOTrainer(
            plain,
            D.arithmetic_reward,
            args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False),
            train_dataset=dataset,
        )


def test_is_ratio_modes():
    old = torch.tensor([[0.0, -1.0, -2.0], [-1.0, -1.0, 0.0]])
    sampling = torch.tensor([[0.0, -2.0, -1.0], [-1.0, -3.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])

    def ratio(mode, lo=None, hi=3.0):
        return importance_sampling_ratio(old, sampling, mask, mode, lo, hi)

    e = torch.exp(torch.tensor(1.0))
    torch.testing.assert_close(ratio("token_truncate"), torch.tensor([[1.0, e, 1 / e], [1.0, 3.0, 1.0]]))
    torch.testing.assert_close(ratio("token_mask"), torch.tensor([[1.0, e, 1 / e], [1.0, 0.0, 1.0]]))
    torch.testing.assert_close(ratio("token_truncate", lo=0.5), torch.tensor([[1.0, e, 0.5], [1.0, 3.0, 1.0]]))
    torch.testing.assert_close(ratio("sequence_truncate"), torch.tensor([[1.0], [3.0]]))
    torch.testing.assert_close(ratio("sequence_mask"), torch.tensor([[1.0], [0.0]]))


# ----------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------


def run_steps(model, tmp_path, dataset, **kw):
    experts = fp4_experts(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    packed_before = [m.packed_weights()[0].dequantize(torch.float32) for m in experts]
    trainer = make(model, tmp_path, dataset, **kw)
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    return trainer, experts, packed_before, changed


def test_train_hints_on_and_off(tmp_path, model_dir, dataset):
    gaps = {}
    for hints in (True, False):
        model = perturb_rollout(load(model_dir))
        # With hints: gradient checkpointing on (TRL's default), so backward recomputes under the hints.
        trainer, experts, packed_before, changed = run_steps(
            model,
            tmp_path / str(hints),
            dataset,
            trace_hints=hints,
            routing_replay=hints,
            activation_checkpointing=hints,
            max_steps=3,
        )
        for key in METRICS:
            values = history(trainer, key)
            assert len(values) == 3 and all(v == v for v in values), (key, values)
        assert history(trainer, "trace/hint_bytes_per_token")[0] == (4 * (64 // 8 + 64 // 16 + 4) if hints else 0)
        # Every parameter trained, the experts' master weights included.
        assert any(".experts.gate_up_proj" in n for n in changed) and any(".experts.down_proj" in n for n in changed)
        assert any("q_proj" in n for n in changed)
        # The packed rollout weights follow the masters after the optimizer steps.
        for m, old in zip(experts, packed_before, strict=True):
            new = m.packed_weights()[0].dequantize(torch.float32)
            assert not torch.equal(new, old)
            fresh = fp4.quantize(m.gate_up_proj.detach(), m.fmt, scale="expert").dequantize(torch.float32)
            assert torch.equal(new, fresh)
        if hints:
            # The gradient forward, after TRL's shuffle and split, met its own rows' hints: misaligned hints would
            # disagree with nearest rounding on a large fraction of elements.
            assert max(history(trainer, "trace/train/hint_flip_rate")) < 0.2
        gaps[hints] = sum(history(trainer, "sampling/sampling_logp_difference/mean")) / 3
    print("mean logp gap rollout/train, hints on/off:", gaps)
    assert gaps[True] < 0.5 * gaps[False], gaps


def test_bf16_rollout_baseline(tmp_path, model_dir, dataset):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    before = model.lm_head.weight.detach().clone()
    trainer = make(model, tmp_path, dataset, rollout_precision="bf16", trace_hints=False, routing_replay=False)
    trainer.train()
    assert not torch.equal(before, model.lm_head.weight)
    assert len(history(trainer, "sampling/sampling_logp_difference/mean")) == 2
    assert "trace/hint_flip_rate" not in trainer.state.log_history[0]


def test_sequence_is_and_cpu_storage(tmp_path, model_dir, dataset):
    trainer = make(
        load(model_dir, hint_layers=None, kv_cache="nvfp4"),
        tmp_path,
        dataset,
        trace_hint_storage="cpu",
        rollout_importance_sampling_mode="sequence_mask",
        max_steps=1,
    )
    trainer.train()
    assert len(history(trainer, "sampling/importance_sampling_ratio/mean")) == 1


# ----------------------------------------------------------------------------------------------------------
# PEFT
# ----------------------------------------------------------------------------------------------------------


def test_peft_lora_on_attention_trains(tmp_path, model_dir, dataset):
    from peft import LoraConfig

    model = load(model_dir)
    experts_before = [m.gate_up_proj.detach().clone() for m in fp4_experts(model)]
    trainer = make(
        model,
        tmp_path,
        dataset,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
        max_steps=1,
        activation_checkpointing=False,
    )
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert lora
    trainer.train()
    assert any(not torch.equal(v, dict(trainer.model.named_parameters())[n]) for n, v in lora.items())
    for m, old in zip(fp4_experts(trainer.model), experts_before, strict=True):
        assert torch.equal(m.gate_up_proj, old)  # frozen base: the packed rollout weights stay valid
    assert len(history(trainer, "trace/hint_flip_rate")) == 1


def test_peft_on_experts_is_refused(tmp_path, model_dir, dataset):
    from peft import LoraConfig

    cfg = LoraConfig(r=4, target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    with pytest.raises(ValueError, match="FP4 routed experts"):
        make(load(model_dir), tmp_path, dataset, peft_config=cfg)


def test_log_prob_forwards_skip_each_chunks_padding(tmp_path, model_dir, dataset):
    """TRL pads every completion to the generation batch's longest; each row chunk's forward sees only the columns
    where one of its rows has a real token, and gives the same log-probs there (zeros on the cut padding)."""
    # The padded path (the packed one: test_packed_forwards).
    trainer = make(load(model_dir), tmp_path, dataset, token_budget=0)
    model = trainer.model
    g = torch.Generator().manual_seed(0)
    prompt, completion = (3, 5, 2, 2), (6, 4, 1, 2)  # rows 2-3 (the second chunk): 3 pad columns left, 4 right
    P, C = max(prompt), max(completion)
    ids = torch.randint(4, 60, (4, P + C), generator=g)
    mask = torch.zeros_like(ids)
    for r, (p, c) in enumerate(zip(prompt, completion, strict=True)):
        mask[r, P - p : P + c] = 1
    ids = ids.masked_fill(mask == 0, 0)
    widths = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    model.train()
    with torch.no_grad():
        whole, ent_whole, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, C, 4, compute_entropy=True)
        chunked, ent_chunked, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, C, 2, compute_entropy=True
        )
    hook.remove()
    # rows 2-3 (the shortest) go first, cut 3 + 4; rows 0-1 span the whole width
    assert widths == [P + C, P + C - 7, P + C], widths
    real = mask[:, P:].bool()
    torch.testing.assert_close(chunked[real], whole[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_chunked[real], ent_whole[real], rtol=1e-5, atol=1e-5)
    assert chunked.shape == whole.shape == (4, C)
    assert torch.all(chunked[2:, 2:] == 0) and torch.all(ent_chunked[2:, 2:] == 0)


def test_log_prob_forwards_pack_short_rows_and_put_rows_back(tmp_path, model_dir, dataset):
    """With one row per forward, rows that stop early share a forward (as many as fit the tokens of one full-width
    row) and a long row keeps its own; every row's log-probs come back in its own place, equal to its own forward's."""
    # The padded path (the packed one: test_packed_forwards).
    trainer = make(load(model_dir), tmp_path, dataset, token_budget=0)
    model = trainer.model
    g = torch.Generator().manual_seed(1)
    completion = (2, 30, 1, 3, 30, 2)  # rows 1 and 4 run to the cap, the others stop early
    P, C = 4, max(completion)
    ids = torch.randint(4, 60, (len(completion), P + C), generator=g)
    mask = torch.zeros_like(ids)
    for r, c in enumerate(completion):
        mask[r, : P + c] = 1
    ids = ids.masked_fill(mask == 0, 0)
    rows = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
    model.train()
    with torch.no_grad():
        packed, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, C, 1)
        alone = [trainer._get_per_token_logps_and_entropies(model, ids[r : r + 1], mask[r : r + 1], C, 1)[0]
                 for r in range(len(completion))]  # fmt: skip
    hook.remove()
    assert rows[:3] == [4, 1, 1], rows  # the four short rows (7 columns at most, 4 x 7 <= 34) in one forward
    real = mask[:, P:].bool()
    torch.testing.assert_close(packed[real], torch.cat(alone)[real], rtol=1e-5, atol=1e-5)
    assert torch.all(packed[~real] == 0)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"loss_type": "bnpo"}, "loss_type='bnpo'"),
        ({"steps_per_generation": 4}, "steps_per_generation=4"),
        ({"top_entropy_quantile": 0.5}, "top_entropy_quantile=0.5"),
    ],
)
def test_group_by_length_is_refused_where_it_would_change_the_gradient(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        config(tmp_path, train_sampling_strategy="group_by_length", **kw)


def test_other_sampling_strategies_are_refused_not_ignored(tmp_path):
    with pytest.raises(ValueError, match="'random'.*'group_by_length'"):
        config(tmp_path, train_sampling_strategy="sequential")


def test_grouped_micro_batches_give_the_same_step(tmp_path, model_dir):
    """One GRPO step with micro-batches grouped by length trains to the same weights as TRL's random order (same
    rollouts: the seed is the same and TRL shuffles first in both), and its micro-batches are sorted by length. The
    router aux loss is off: TRL computes it per micro-batch, so it depends on which tokens share one in any order."""
    # every prompt of its own length: a generation batch holds two of them, four generations each
    ds = Dataset.from_dict(
        {"prompt": [D.format_prompt("1" * k + "+2") for k in range(1, 9)], "answer": ["#### 3"] * 8}
    )
    seen, trained = {}, {}
    for strategy in ("random", "group_by_length"):
        model = load(model_dir)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        trainer = make(model, tmp_path / strategy, ds, max_steps=1, train_sampling_strategy=strategy, optim="sgd",
                       learning_rate=0.1, router_aux_loss_coef=0.0, per_device_train_batch_size=2,
                       gradient_accumulation_steps=4)  # fmt: skip
        compute, seen[strategy] = trainer._compute_loss, []

        def spy(model, inputs, compute=compute, log=seen[strategy]):
            log.append((inputs["prompt_mask"].sum(1) + inputs["completion_mask"].sum(1)).tolist())
            return compute(model, inputs)

        trainer._compute_loss = spy
        trainer.train()
        trained[strategy] = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    flat = {k: [n for mb in v for n in mb] for k, v in seen.items()}
    assert len(seen["group_by_length"]) == 4 and flat["group_by_length"] == sorted(flat["random"]), seen
    assert flat["random"] != sorted(flat["random"]), seen  # TRL's order mixed the lengths (seed 0)
    assert any(not torch.equal(trained["random"][n], p) for n, p in before.items()), "the step changed nothing"
    for name, p in trained["random"].items():  # SGD: the update is the gradient (Adam's first step is its sign)
        torch.testing.assert_close(trained["group_by_length"][name], p, rtol=1e-5, atol=1e-7, msg=name)
