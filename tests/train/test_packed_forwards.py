# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Padding-free packed training-side forwards (`TraceGRPOConfig.token_budget`) on the tiny Qwen3 MoE and Qwen3.5 MoE
(Gated DeltaNet given its rows right-padded): the same log-probs, hints, routing and step as TRL's padded row micro-batches, rows
kept apart, fewer forwards. And the scoring forward skipped where TRL keeps no old log-probs
(`skip_scoring_forward`): the same step and metrics from the training forwards alone."""

from __future__ import annotations

import threading

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from trace_hf import TraceFP4Config
from trace_hf import data as D
from trace_hf import testing as T
from trace_hf.hints import HintBatch, MismatchReport
from trace_hf.train import TraceGRPOConfig, TraceGRPOTrainer
from trace_hf.train.trainer import HINT_PREFIX


pytestmark = pytest.mark.usefixtures("one_thread")

SITES = ["experts_input", "experts_hidden", "kv"]
TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe_text"])
def model_dir(tmp_path_factory, request):
    return T.save_tiny_model(tmp_path_factory.mktemp("tiny") / request.param, request.param)


@pytest.fixture(scope="module")
def dataset():
    # prompts of several lengths, so that rows are left-padded differently
    rows = [(a, b) for a in (1, 22, 333, 4444) for b in range(4)]
    return Dataset.from_dict(
        {"prompt": [D.format_prompt(f"{a}+{b}") for a, b in rows], "answer": [f"#### {a + b}" for a, b in rows]}
    )


def load(path, dtype=torch.float32, device="cpu", **quant):
    quant = {"hint_layers": 4, "hint_sites": SITES, **quant}  # every MoE layer hinted, at every site
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=TraceFP4Config(**quant))
    model.to(device)
    with torch.no_grad():  # EOS likely enough that completions stop at many lengths: rows right-padded too
        ids = T.build_char_tokenizer()(D.format_prompt("12+3"), return_tensors="pt").input_ids
        d = model.model(input_ids=ids.to(device)).last_hidden_state[0].mean(0)
        model.lm_head.weight[model.config.eos_token_id] = 5 * d / d.dot(d)
    # The rollout's own rounding, as in test_trainer: noise on the MoE input in eval mode, so hints and replay act.
    gen = torch.Generator().manual_seed(0)

    def hook(module, args, output):
        noise = torch.randn(output.shape, generator=gen).to(output)
        return output if module.training else output * (1 + 1e-2 * noise)

    for layer in model.model.layers:
        layer.post_attention_layernorm.register_forward_hook(hook)
    return model


def varied_reward(completions, **kwargs):
    return [float(sum(map(ord, c)) % 7) / 7 for c in completions]


def make(model, tmp_path, dataset, **kw):
    base = {
        "output_dir": str(tmp_path), "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
        "num_generations": 4, "max_completion_length": 8, "max_steps": 1, "learning_rate": 0.1, "optim": "sgd",
        "logging_steps": 1, "save_strategy": "no", "report_to": "none", "seed": 0, "bf16": False, "use_cpu": True,
        "dataloader_pin_memory": False, "disable_tqdm": True,
    }  # fmt: skip
    return TraceGRPOTrainer(
        model,
        [D.arithmetic_reward, varied_reward],
        args=TraceGRPOConfig(**{**base, **kw}),
        train_dataset=dataset,
        processing_class=T.build_char_tokenizer(),
    )


def loss_inputs(trainer) -> list[dict]:
    """The micro-batches TRL's loss saw during `trainer.train()` (hint columns, IS ratio and all)."""
    seen, compute = [], trainer._compute_loss

    def spy(model, inputs):
        seen.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
        return compute(model, inputs)

    trainer._compute_loss = spy
    trainer.train()
    trainer._compute_loss = compute
    return seen


def score(trainer, inputs, budget, batch_size=1):
    """A scoring pass over ``inputs``'s rows with their hints: (log-probs, entropies, merged report)."""
    trainer.token_budget = budget  # the resolved budget: None pads
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    step, reports = trainer._trace_state, []
    step.rows = HintBatch.from_inputs(inputs, trainer._fmt, trainer._hint_layers, HINT_PREFIX)
    step.reports = reports
    try:
        with torch.no_grad():
            logps, ent, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, inputs["completion_ids"].size(1), batch_size, compute_entropy=True
            )
    finally:
        step.rows = step.reports = None
    return logps, ent, MismatchReport.merged(reports)


# ----------------------------------------------------------------------------------------------------------
# (1) The same log-probs, hints and routing as the padded path
# ----------------------------------------------------------------------------------------------------------


def test_packed_logps_equal_padded_with_hints_and_replay(tmp_path, model_dir, dataset):
    # The hints stay the policy's own; the scoring forward runs, so its IS ratio is in the inputs TRL's loss sees.
    trainer = make(load(model_dir), tmp_path, dataset, learning_rate=0.0, skip_scoring_forward=False)
    batches = loss_inputs(trainer)
    assert all("importance_sampling_ratio" in b for b in batches)
    inputs = {k: torch.cat([b[k] for b in batches]) for k, v in batches[0].items() if torch.is_tensor(v) and v.dim()}
    real = inputs["completion_mask"].bool()
    trainer.model.train()
    padded, ent_padded, rep_padded = score(trainer, inputs, None)
    for budget in (1, 40, 10_000):  # a forward per row, a few rows per forward, all rows in one
        packed, ent_packed, rep_packed = score(trainer, inputs, budget)
        torch.testing.assert_close(packed[real], padded[real], **TOL)
        torch.testing.assert_close(ent_packed[real], ent_padded[real], **TOL)
        assert torch.all(packed[~real] == 0) and torch.all(ent_packed[~real] == 0)  # TRL's layout: 0 at padding
        # Every row met its own hints and recorded routes: the same flips, routes and coverage as padded.
        assert rep_packed.counts_by_site() == rep_padded.counts_by_site()
        assert int(rep_packed.routing_diff) == int(rep_padded.routing_diff)
        assert rep_packed.routing_total == rep_padded.routing_total
        assert (rep_packed.hinted_tokens, rep_packed.real_tokens) == (rep_padded.hinted_tokens, rep_padded.real_tokens)
    assert rep_padded.total_flips > 0 and rep_padded.hinted_tokens > 0  # the hints had something to correct


# ----------------------------------------------------------------------------------------------------------
# (2) No packed row attends to another
# ----------------------------------------------------------------------------------------------------------


def test_other_rows_are_bit_identical_when_one_row_changes(tmp_path, model_dir, dataset):
    trainer = make(load(model_dir), tmp_path, dataset, token_budget=10_000)
    g = torch.Generator().manual_seed(0)
    prompt, completion = (5, 2, 4), (6, 8, 3)
    P, C = max(prompt), max(completion)
    ids = torch.randint(4, 60, (3, P + C), generator=g)
    mask = torch.zeros_like(ids)
    for r, (p, c) in enumerate(zip(prompt, completion, strict=True)):
        mask[r, P - p : P + c] = 1
    ids = ids.masked_fill(mask == 0, 0)
    other = ids.clone()
    other[1] = torch.where(mask[1].bool(), torch.randint(4, 60, (P + C,), generator=g), 0)
    model = trainer.model.train()
    with torch.no_grad():
        a = trainer._get_per_token_logps_and_entropies(model, ids, mask, C, 3, compute_entropy=True)
        b = trainer._get_per_token_logps_and_entropies(model, other, mask, C, 3, compute_entropy=True)
    assert (a[0][1] - b[0][1]).abs().max() > 1e-2  # the changed row's log-probs moved
    for r in (0, 2):
        if "qwen3_5" in model_dir:
            # Its CPU expert GEMMs sum a token's products in another order when the tokens sharing its expert change
            # (padded or packed: a batch-composition effect of ~1e-9, not attention); a row that saw another row's
            # tokens would move as much as the changed row does.
            torch.testing.assert_close(a[0][r], b[0][r], rtol=0, atol=1e-6)
            torch.testing.assert_close(a[1][r], b[1][r], rtol=0, atol=1e-6)
        else:
            assert torch.equal(a[0][r], b[0][r]) and torch.equal(a[1][r], b[1][r]), r


# ----------------------------------------------------------------------------------------------------------
# (3) One optimizer step: packed == padded
# ----------------------------------------------------------------------------------------------------------


def _metrics(trainer) -> dict:
    skip = ("seconds", "tokens_per_second", "runtime", "per_second", "step_time")
    out = {}
    for h in trainer.state.log_history:
        out.update({k: v for k, v in h.items() if isinstance(v, (int, float)) and not any(s in k for s in skip)})
    return out


@pytest.mark.parametrize(
    "kw",
    [
        {"loss_type": "grpo"},
        {"loss_type": "bnpo"},
        {"loss_type": "dr_grpo"},
        {"loss_type": "dapo"},
        {"loss_type": "grpo", "importance_sampling_level": "sequence"},  # GSPO
        {"loss_type": "dapo", "beta": 0.05, "top_entropy_quantile": 0.5},  # reference model, entropy mask
        {"loss_type": "grpo", "gated_delta_rule": "recurrent"},  # Qwen3.5: the rollout's recurrent values
    ],
    ids=["grpo", "bnpo", "dr_grpo", "dapo", "gspo", "dapo-ref-entropy", "grpo-recurrent"],
)
def test_one_step_packed_equals_padded(tmp_path, model_dir, dataset, kw):
    if "gated_delta_rule" in kw and "qwen3_5" not in model_dir:
        pytest.skip("Qwen3 MoE has no Gated DeltaNet layers")
    params, metrics, rows = {}, {}, {}
    for budget in (0, 24):  # 0: TRL's padded micro-batches
        model = load(model_dir)
        # The scoring forwards run (skip_scoring_forward=False), so that their packing is compared too.
        trainer = make(model, tmp_path / str(budget), dataset, token_budget=budget, skip_scoring_forward=False, **kw)
        rows[budget] = []

        def spy(module, args, kwargs, log=rows[budget]):
            if module.training:  # the training-side forwards (the rollout runs in eval mode)
                log.append((kwargs["input_ids"].shape[0], torch.is_grad_enabled()))

        hook = model.register_forward_pre_hook(spy, with_kwargs=True)
        trainer.train()
        hook.remove()
        params[budget] = {n: p.detach().clone() for n, p in model.named_parameters()}
        metrics[budget] = _metrics(trainer)
    # Packed: one sequence per forward; the two loss forwards hold TRL's micro-batches of 4 rows, padded or not.
    assert {b for b, _ in rows[24]} == {1} and [g for _, g in rows[24]].count(True) == 2, rows
    assert [b for b, g in rows[0] if g] == [4, 4], rows
    assert len(rows[24]) > len(rows[0]), rows  # rows of 10-20 tokens: one or two per 24-token forward
    before = dict(load(model_dir).named_parameters())
    assert any(not torch.equal(before[n], p) for n, p in params[0].items()), "the step changed nothing"
    for name, p in params[0].items():
        torch.testing.assert_close(params[24][name], p, rtol=1e-5, atol=1e-6, msg=name)
    assert metrics[24].keys() == metrics[0].keys()
    for key, value in metrics[0].items():
        assert metrics[24][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def _training_side_forwards(model) -> tuple[list, object]:
    """A log of the model's training-side forwards (whether each ran with grad) and the hook that fills it; the
    rollout runs in eval mode and is not logged."""
    log = []

    def spy(module, args, kwargs):
        if module.training:
            log.append(torch.is_grad_enabled())

    return log, model.register_forward_pre_hook(spy, with_kwargs=True)


@pytest.mark.parametrize(
    "kw",
    [
        {"loss_type": "grpo"},
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "rollout_importance_sampling_mode": "sequence_truncate"},
        {"loss_type": "dapo", "beta": 0.05, "top_entropy_quantile": 0.5},  # reference model, entropy mask
        {"loss_type": "vespo"},  # reads the IS ratio itself
        {"loss_type": "grpo", "token_budget": 0},  # TRL's padded micro-batches
    ],
    ids=["grpo", "gspo-sequence-is", "dapo-ref-entropy", "vespo", "grpo-padded"],
)  # fmt: skip
def test_skipping_the_scoring_forward_gives_the_same_step_and_metrics(tmp_path, model_dir, dataset, kw):
    params, metrics, forwards = {}, {}, {}
    for skip in (False, True):
        model = load(model_dir)
        trainer = make(model, tmp_path / str(skip), dataset, skip_scoring_forward=skip, **kw)
        forwards[skip], hook = _training_side_forwards(model)
        trainer.train()
        hook.remove()
        params[skip] = {n: p.detach().clone() for n, p in model.named_parameters()}
        metrics[skip] = _metrics(trainer)
    # Skipped: only the two loss forwards (TRL's micro-batches of 4 rows); else the no-grad scoring forwards too.
    assert forwards[True] == [True, True], forwards
    assert forwards[False].count(False) >= 1 and forwards[False].count(True) == 2, forwards
    before = dict(load(model_dir).named_parameters())
    assert any(not torch.equal(before[n], p) for n, p in params[False].items()), "the step changed nothing"
    for name, p in params[False].items():
        torch.testing.assert_close(params[True][name], p, rtol=1e-5, atol=1e-6, msg=name)
    assert metrics[True].keys() == metrics[False].keys()
    assert "trace/kl_rollout_train" in metrics[True] and "sampling/importance_sampling_ratio/max" in metrics[True]
    for key, value in metrics[False].items():
        assert metrics[True][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.gpu
def test_skipping_the_scoring_forward_on_cuda_in_bf16_gpu(tmp_path, model_dir, dataset):
    """The trainer's precision on the GPU (bf16, CUDA rollout, varlen flash attention): only the loss forwards run,
    and the step and metrics match the scoring forward's within bf16 rounding (the two pack rows differently)."""
    params, metrics, forwards = {}, {}, {}
    for skip in (False, True):
        model = load(model_dir, dtype=torch.bfloat16, device="cuda")
        trainer = make(model, tmp_path / str(skip), dataset, skip_scoring_forward=skip, bf16=True, use_cpu=False)
        forwards[skip], hook = _training_side_forwards(model)
        trainer.train()
        hook.remove()
        params[skip] = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
        metrics[skip] = _metrics(trainer)
    assert forwards[True] == [True, True], forwards
    assert forwards[False].count(False) >= 1, forwards
    for name, p in params[False].items():
        torch.testing.assert_close(params[True][name], p, rtol=2e-2, atol=2e-2, msg=name)
    assert metrics[True].keys() == metrics[False].keys()
    for key in ("trace/kl_rollout_train", "sampling/importance_sampling_ratio/mean", "loss"):
        assert metrics[True][key] == pytest.approx(metrics[False][key], rel=5e-2, abs=5e-3), key


@pytest.mark.parametrize("per_row", [False, True], ids=["token-ratio", "sequence-ratio"])
def test_micro_batch_sums_add_up_to_the_batchs(per_row):
    """The loss forwards' metric sums (kept on the device, no host sync) added over micro-batches are the whole
    batch's: what a scoring forward over all rows would log."""
    from trace_hf.train.trainer import _add_sums, _scored_sums

    g = torch.Generator().manual_seed(0)
    old, sampling = torch.randn(6, 9, generator=g), torch.randn(6, 9, generator=g)
    sampling[1, 2] = float("nan")  # a token without a sampler log-prob is not counted
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    ratio = torch.rand(6, 1 if per_row else 9, generator=g) * 2
    whole = _scored_sums(old, sampling, mask, ratio)
    parts = [_scored_sums(old[i : i + 2], sampling[i : i + 2], mask[i : i + 2], ratio[i : i + 2]) for i in (0, 2, 4)]
    added = _add_sums(_add_sums(parts[0], parts[1]), parts[2])
    m = mask.bool() & ~torch.isnan(sampling)
    d = (old - sampling)[m]
    r = ratio.flatten() if per_row else ratio[m]
    want = {"logp_diff": d.abs().sum(), "tokens": m.sum(), "kl": (torch.expm1(d) - d).sum(),
            "logp_diff_max": d.abs().max(), "ratio": r.sum(), "ratio_n": r.numel(), "ratio_min": r.min(),
            "ratio_max": r.max()}  # fmt: skip
    assert added.keys() == whole.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(added[key].double(), torch.as_tensor(value).double(), rtol=1e-5, atol=0, msg=key)
        torch.testing.assert_close(whole[key].double(), torch.as_tensor(value).double(), rtol=1e-5, atol=0, msg=key)


def test_trls_old_logprob_forward_is_the_scoring_forward(tmp_path, model_dir, dataset):
    """A generation batch over two optimizer steps: the policy changes between the rollout and the second step's
    forwards, so TRL keeps old log-probs. Its own no-grad forward of them is the scoring forward: one pass over the
    batch (not a second one of trace-hf's), whose log-probs give the IS ratio and whose hints give the metrics."""
    from trace_hf.train.importance import importance_sampling_ratio

    trainer = make(load(model_dir), tmp_path, dataset, steps_per_generation=4, skip_scoring_forward=True)
    passes, inner = [], trainer._trace_logps_and_entropies

    def spy(*args):
        passes.append(torch.is_grad_enabled())
        return inner(*args)

    trainer._trace_logps_and_entropies = spy
    seen = loss_inputs(trainer)
    assert passes == [False, True, True], passes  # one scoring pass, then the step's two loss forwards
    assert len(seen) == 2
    for x in seen:
        ratio = importance_sampling_ratio(
            x["old_per_token_logps"], x["sampling_per_token_logps"], x["completion_mask"], "token_truncate",
            trainer.args.rollout_importance_sampling_clip_min, trainer.args.rollout_importance_sampling_clip_max,
        )  # fmt: skip
        torch.testing.assert_close(x["importance_sampling_ratio"], ratio, rtol=0, atol=0)
    metrics = _metrics(trainer)
    assert "trace/hint_flip_rate/experts_input" in metrics and "trace/kl_rollout_train" in metrics, sorted(metrics)
    assert metrics["trace/hint_coverage"] > 0.5


# ----------------------------------------------------------------------------------------------------------
# (4) Fewer scoring forwards as the budget grows; a long row is never dropped
# ----------------------------------------------------------------------------------------------------------


def test_scoring_forwards_fall_as_the_budget_grows(tmp_path, model_dir, dataset):
    trainer = make(load(model_dir), tmp_path, dataset, trace_hints=False, routing_replay=False)
    g = torch.Generator().manual_seed(2)
    completion = (2, 30, 1, 3, 30, 2, 5, 4)
    P, C = 4, max(completion)
    ids = torch.randint(4, 60, (len(completion), P + C), generator=g)
    mask = torch.zeros_like(ids)
    for r, c in enumerate(completion):
        mask[r, : P + c] = 1
    ids = ids.masked_fill(mask == 0, 0)
    model = trainer.model.train()
    shapes = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: shapes.append(kw["input_ids"].shape), with_kwargs=True)
    counts, out = {}, {}
    with torch.no_grad():
        for budget in (None, 8, 20, 40, 80, 10_000):
            trainer.token_budget, shapes[:] = budget, []
            out[budget] = trainer._get_per_token_logps_and_entropies(model, ids, mask, C, 2)[0]
            counts[budget] = len(shapes)
            if budget is not None:
                assert all(s[0] == 1 for s in shapes)  # one packed sequence per forward
                assert sum(s[1] for s in shapes) == int(mask.sum())  # every real token, no padding, none dropped
    hook.remove()
    packed = [counts[b] for b in (8, 20, 40, 80, 10_000)]
    assert packed == sorted(packed, reverse=True) and packed[0] > packed[-1] == 1, counts
    assert packed[0] == len(completion)  # a budget below every row: each row alone (rows of 34 tokens > 8 too)
    real = mask[:, P:].bool()
    for budget in (8, 20, 40, 80, 10_000):
        torch.testing.assert_close(out[budget][real], out[None][real], **TOL)


def test_gated_deltanet_chunks_count_the_padding_their_layers_take():
    """`token_chunks(padded=True)` (Gated DeltaNet models, whose layers take a forward's rows padded to its longest)
    bounds rows x longest, not the real tokens: many short rows beside a long one would otherwise pad to several
    times the budget. Both ways the rows stay in order, none is dropped, a row over the budget runs alone, and the
    count of forwards never rises with the budget."""
    from trace_hf.train.packing import token_chunks

    lengths = [2, 30, 1, 3, 30, 2, 5, 4]
    assert token_chunks(lengths, 40) == [(0, 4), (4, 7), (7, 8)]
    assert token_chunks(lengths, 40, padded=True) == [(0, 1), (1, 2), (2, 4), (4, 5), (5, 8)]
    for padded in (False, True):
        counts = []
        for budget in (1, 8, 20, 40, 64, 100, 300, None):
            chunks = token_chunks(lengths, budget, padded=padded)
            assert [lo for lo, _ in chunks] == [0] + [hi for _, hi in chunks[:-1]] and chunks[-1][1] == len(lengths)
            for lo, hi in chunks:
                rows = lengths[lo:hi]
                cost = len(rows) * max(rows) if padded else sum(rows)
                assert budget is None or hi - lo == 1 or cost <= budget
            counts.append(len(chunks))
        assert counts == sorted(counts, reverse=True) and counts[0] == len(lengths) and counts[-1] == 1


# ----------------------------------------------------------------------------------------------------------
# (5) Refusals name the fix
# ----------------------------------------------------------------------------------------------------------


def test_the_default_packs_where_exact_and_measured(tmp_path, dataset):
    """token_budget=None: the all-attention Qwen3 MoE and the Qwen3.5 MoE (Gated DeltaNet) pack (each scoring forward
    holding its padded micro-batch's tokens); 0 pads; a budget packs both; a model that cannot pack is left padded
    by the default rather than refused."""
    kw = {"rollout_precision": "bf16", "trace_hints": False, "routing_replay": False}
    qwen3, hybrid = T.tiny_model(), T.tiny_model("qwen3_5_moe_text")
    assert make(qwen3, tmp_path, dataset, **kw).token_budget == "auto"
    assert make(qwen3, tmp_path, dataset, token_budget=0, **kw).token_budget is None
    assert make(hybrid, tmp_path, dataset, **kw).token_budget == "auto"
    assert make(hybrid, tmp_path, dataset, token_budget=-1, **kw).token_budget is None
    assert make(hybrid, tmp_path, dataset, token_budget=512, **kw).token_budget == 512
    windowed = T.tiny_model(layer_types=["full_attention", "sliding_attention"] * 2, sliding_window=4)
    assert make(windowed, tmp_path, dataset, **kw).token_budget is None
    # "auto" on a scoring pass: forwards of one packed sequence each, holding at most batch_size x width tokens.
    trainer = make(qwen3, tmp_path, dataset, **kw)
    g = torch.Generator().manual_seed(1)
    completion = (2, 9, 1, 3, 9, 2)
    ids = torch.randint(4, 60, (len(completion), 4 + 9), generator=g)
    mask = torch.zeros_like(ids)
    for r, c in enumerate(completion):
        mask[r, : 4 + c] = 1
    shapes = []
    hook = qwen3.register_forward_pre_hook(lambda m, a, kw: shapes.append(kw["input_ids"].shape), with_kwargs=True)
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies(qwen3.train(), ids, mask, 9, 2)
    hook.remove()
    # Rows of 6, 13, 5, 7, 13, 6 real tokens under a budget of 2 x 13: two forwards where padding ran three.
    assert [tuple(s) for s in shapes] == [(1, 24), (1, 26)], shapes


def test_refusals(tmp_path, dataset):
    base = {"output_dir": str(tmp_path), "use_cpu": True, "bf16": False, "report_to": "none"}
    for bad in (1.5, "4096", True):
        with pytest.raises(ValueError, match="token_budget=.*0 for TRL's padded"):
            TraceGRPOConfig(**base, token_budget=bad)
    # Sliding-window layers are not packed.
    windowed = T.tiny_model(layer_types=["full_attention", "sliding_attention"] * 2, sliding_window=4)
    with pytest.raises(ValueError, match="sliding_attention.*token_budget=0"):
        make(windowed, tmp_path, dataset, token_budget=512, rollout_precision="bf16", trace_hints=False,
             routing_replay=False)  # fmt: skip
    # An attention implementation that transformers' packed-sequence masks do not reach.
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("unpackable_test_attention", sdpa_attention_forward)
    plain = T.tiny_model(attn_implementation="unpackable_test_attention")
    with pytest.raises(ValueError, match="attn_implementation='sdpa'.*token_budget=0"):
        make(plain, tmp_path, dataset, token_budget=512, rollout_precision="bf16", trace_hints=False,
             routing_replay=False)  # fmt: skip


def _packed_qkv(lengths, device, dtype, hq=4, hkv=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q, k, v = (torch.randn(1, h, n, dim, generator=g).to(device, dtype) for h in (hq, hkv, hkv))
    return q, k, v


def _per_row(q, k, v, lengths, scale):
    """Each row on its own, as the padded path computes it: causal sdpa over that row's tokens (GQA expanded)."""
    rep = q.size(1) // k.size(1)
    outs = []
    for qs, ks, vs in zip(*(t.split(lengths, dim=2) for t in (q, k, v)), strict=True):
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale))
    return torch.cat(outs, dim=2).transpose(1, 2)  # transformers' [1, tokens, heads, dim]


def test_packed_attention_is_each_rows_own_causal_attention_and_builds_no_mask(model_dir, monkeypatch):
    from trace_hf.train import packing

    lengths = [5, 1, 9, 3]
    q, k, v = _packed_qkv(lengths, "cpu", torch.float32)
    with packing.packed_attention(torch.nn.Linear(1, 1), lengths):
        out, weights = packing.varlen_attention(None, q, k, v, None, scaling=0.25)
    assert weights is None
    torch.testing.assert_close(out, _per_row(q, k, v, lengths, 0.25), rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="packed forward"):
        packing.varlen_attention(None, q, k, v, None)  # outside a packed forward
    # The checkpointed recompute runs in backward, on autograd's device threads on CUDA: the rows are seen there too.
    seen = []
    with packing.packed_attention(torch.nn.Linear(1, 1), lengths):
        worker = threading.Thread(target=lambda: seen.append(packing.varlen_attention(None, q, k, v, None, 0.25)[0]))
        worker.start()
        worker.join()
    assert len(seen) == 1 and torch.equal(seen[0], out)
    with packing.packed_attention(torch.nn.Linear(1, 1), [2, 2]), pytest.raises(RuntimeError, match="another packed"):
        packing.varlen_attention(None, q, k, v, None)  # 18 tokens under a 4-token packed forward

    # In a model: every config runs the packed attention (under the FP4 K/V wrapper), no dense mask is built, and
    # everything is restored afterwards.
    model = load(model_dir).train()  # training mode: no rollout noise (load's hook), the QAT forward
    before = model.config._attn_implementation
    assert before.startswith("trace_fp4_kv:")
    masks = []
    sdpa_mask = packing.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    monkeypatch.setitem(packing.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "sdpa", lambda *a, **kw: masks.append(1))
    ids = torch.tensor([[4, 85, 54, 60, 4, 85, 56]])
    with torch.no_grad(), packing.packed_attention(model, [3, 4]):
        assert model.config._attn_implementation == "trace_fp4_kv:nvfp4:trace_packed"
        packed = model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]])).logits
    assert not masks and model.config._attn_implementation == before
    packing.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = sdpa_mask
    with torch.no_grad():
        rows = [model(input_ids=ids[:, :3]).logits, model(input_ids=ids[:, 3:]).logits]
    torch.testing.assert_close(packed, torch.cat(rows, dim=1), **TOL)


def test_gated_deltanet_takes_the_packed_rows_in_one_padded_call():
    """A packed forward gives each Gated DeltaNet layer its rows right-padded to the longest in one call (not a call
    per row), and each row's logits are those of its own forward."""
    from trace_hf.train import packing

    model = T.tiny_model("qwen3_5_moe_text").train()
    mixers = packing.sequence_mixers(model)
    seen = []

    def spy(forward):
        def call(hidden_states, *args, **kwargs):
            seen.append(tuple(hidden_states.shape))
            return forward(hidden_states, *args, **kwargs)

        return call

    for m in mixers:
        m.forward = spy(m.forward)  # what the packed forward wraps
    lengths = [2, 5, 3]
    ids = torch.randint(4, model.config.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad(), packing.packed_attention(model, lengths):
        packed = model(input_ids=ids, position_ids=positions).logits
    assert seen == [(3, 5, model.config.hidden_size)] * len(mixers)
    with torch.no_grad():
        rows = [model(input_ids=r).logits for r in ids.split(lengths, dim=1)]
    torch.testing.assert_close(packed, torch.cat(rows, dim=1), **TOL)


@pytest.mark.gpu
def test_varlen_flash_attention_equals_each_rows_own_attention_gpu():
    from trace_hf.train import packing

    assert packing.varlen_attn is not None, "this torch has no torch.nn.attention.varlen: packing runs sdpa per row"
    lengths = [300, 1, 77, 1024, 5]
    q, k, v = (t.requires_grad_() for t in _packed_qkv(lengths, "cuda", torch.bfloat16, hq=8, hkv=2, dim=128))
    with packing.packed_attention(torch.nn.Linear(1, 1).cuda(), lengths):
        out, _ = packing.varlen_attention(None, q, k, v, None, scaling=128**-0.5)
    want = _per_row(*(t.float() for t in (q, k, v)), lengths, 128**-0.5)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    out.float().square().sum().backward()  # the flash backward runs
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.gpu
def test_packed_attention_in_fp32_on_cuda_runs_each_rows_sdpa_gpu():
    """Flash attention takes half precision only: an fp32 model's packed forward on CUDA attends row by row."""
    from trace_hf.train import packing

    lengths = [30, 1, 77]
    q, k, v = _packed_qkv(lengths, "cuda", torch.float32, hq=8, hkv=2, dim=64)
    with packing.packed_attention(torch.nn.Linear(1, 1).cuda(), lengths):
        out, _ = packing.varlen_attention(None, q, k, v, None, scaling=64**-0.5)
    torch.testing.assert_close(out, _per_row(q, k, v, lengths, 64**-0.5), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "args, scaling, gqa, want",
    [  # varlen_attn's keywords in torch 2.10, 2.11 and 2.12+
        ({"is_causal", "return_aux"}, 0.125, True, {"is_causal": True}),
        ({"is_causal", "return_aux"}, 0.5, False, None),  # no scale argument, and not 1/sqrt(64): per-row sdpa
        ({"scale", "window_size", "return_aux"}, 0.5, True, {"window_size": (-1, 0), "scale": 0.5}),
        (
            {"scale", "window_size", "enable_gqa"},
            0.5,
            True,
            {"window_size": (-1, 0), "scale": 0.5, "enable_gqa": True},
        ),
        ({"scale", "window_size", "enable_gqa"}, None, False, {"window_size": (-1, 0)}),
    ],
)
def test_varlen_keywords_follow_the_torch_release(monkeypatch, args, scaling, gqa, want):
    from trace_hf.train import packing

    monkeypatch.setattr(packing, "_VARLEN_ARGS", frozenset(args))
    assert packing._varlen_kwargs(scaling, 64, gqa) == want
