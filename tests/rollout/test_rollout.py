# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The rollout seam (`trace_hf.rollout`): the engine against `generate`, its sampler, stops and hints, and the
trainer rolling out through it. CPU: the engine runs eagerly through the Triton interpreter, fp32."""

from __future__ import annotations

import pytest
import torch
from rollout_inputs import greedy_config, random_prompts

from trace_hf import TraceFP4Config
from trace_hf import testing as T
from trace_hf.hints import use_hints
from trace_hf.quant.experts import fp4_experts
from trace_hf.quant.quantizer import quantize_model
from trace_hf.rollout import EngineRollout, GenerateRollout, SamplingSettings, make_rollout, unsupported_reason


pytest.importorskip("trace_hf.kernels.sampling")


pytestmark = pytest.mark.usefixtures("one_thread")


SITES = ("experts_input", "experts_hidden", "kv")


def _model(fp4: bool, device="cpu", sites=("experts_input",)):
    torch.manual_seed(0)
    model = T.tiny_model(num_hidden_layers=2)
    if fp4:
        quantize_model(model, TraceFP4Config(hint_layers=2, hint_sites=list(sites)))
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    return model.to(device=device, dtype=dtype).eval()


def _prompts(model, lengths=(5, 3, 7), seed=1):
    return random_prompts(model, lengths, seed)


def _gc(**kw):
    return greedy_config(**{"max_new_tokens": 5, **kw})


@pytest.mark.parametrize("fp4", [True, False])
def test_engine_greedy_matches_generate(fp4):
    """Same tokens; log-probs and hints equal up to fp32 summation order (the engine's kernels vs torch's, ~4e-7
    relative on the logits, measured in test_fast_decode)."""
    model = _model(fp4)
    prompts = _prompts(model)
    a = GenerateRollout()(model, prompts, _gc(), record=fp4)
    b = EngineRollout()(model, prompts, _gc(), record=fp4)
    assert a.completion_ids == b.completion_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-4)
    if fp4:
        ha, hb = a.hints, b.hints
        assert torch.equal(ha.lengths, hb.lengths) and ha.hint_layers == hb.hint_layers
        assert (ha.mantissa_bits == hb.mantissa_bits).float().mean() > 0.999
        assert (ha.block_scale == hb.block_scale).float().mean() > 0.999
        assert (ha.routing == hb.routing).float().mean() > 0.999
        assert torch.allclose(ha.global_scale, hb.global_scale, rtol=1e-5, atol=0)


def test_sampler_matches_truncated_softmax():
    """Empirical frequencies of the engine's draws match transformers' top-k/top-p/min-p truncated softmax."""
    from trace_hf.rollout.sampling import draw, process_logits

    n, V = 2048, 12
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0)).repeat(n, 1) * 2
    s = SamplingSettings(max_new_tokens=1, temperature=0.7, top_k=6, top_p=0.85, min_p=0.02)
    x = process_logits(logits, s)
    # The same truncation by transformers' own warpers, in their order.
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    ref = logits[:1]
    for w in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(6), TopPLogitsWarper(0.85), MinPLogitsWarper(0.02)):
        ref = w(None, ref)
    assert torch.equal(torch.isinf(x[:1]), torch.isinf(ref)) and torch.allclose(x[:1], ref)
    seed, step = torch.tensor([7]), torch.tensor([0])
    tok = draw(x, s, seed, step)
    assert torch.equal(tok, draw(x, s, seed, step))  # same (seed, step): same draws
    assert not torch.equal(tok, draw(x, s, seed, torch.tensor([1])))
    freq = torch.bincount(tok, minlength=V).float() / n
    want = torch.softmax(ref[0], -1)
    assert freq[torch.isinf(ref[0])].sum() == 0  # truncated tokens are never drawn
    assert (freq - want).abs().max() < 0.045, (freq, want)  # ~4 standard errors at n = 2048


def test_engine_seeded_eos_and_repetition_penalty():
    model = _model(False)  # the sampler and stops are the same in both precisions; the dense model is faster here
    prompts = _prompts(model, (4, 6, 5))
    gc = _gc(do_sample=True, temperature=1.3, top_k=50, max_new_tokens=6, eos_token_id=None)
    eng = EngineRollout()
    torch.manual_seed(5)
    a = eng(model, prompts, gc)
    torch.manual_seed(5)
    b = eng(model, prompts, gc)
    torch.manual_seed(6)
    c = eng(model, prompts, gc)
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs
    assert a.completion_ids != c.completion_ids
    assert all(len(x) == 6 for x in a.completion_ids)
    # Make the second token of row 0 an EOS: row 0 stops there, the others run on.
    eos = a.completion_ids[0][1]
    torch.manual_seed(5)
    d = eng(model, prompts, _gc(do_sample=True, temperature=1.3, top_k=50, max_new_tokens=6, eos_token_id=[eos]))
    assert d.completion_ids[0] == a.completion_ids[0][:2]
    others = [r for r in range(1, 3) if eos not in a.completion_ids[r]]
    assert others and all(d.completion_ids[r] == a.completion_ids[r] for r in others)
    # A repetition penalty changes the draws and is applied, not ignored.
    torch.manual_seed(5)
    e = eng(
        model, prompts, _gc(do_sample=True, top_k=50, max_new_tokens=6, repetition_penalty=50.0, eos_token_id=None)
    )
    for p, row in zip(prompts, e.completion_ids, strict=True):
        assert len(set(row)) == len(row) and not set(row) & set(p)  # a huge penalty forbids repeats


def test_engine_hints_guide_training():
    """Training codes at hinted sites equal the engine's rollout codes (>= 99.9%), and routing replay reproduces
    the engine's top-k in the training forward."""
    model = _model(True)
    prompts = _prompts(model, (6, 4, 7))
    torch.manual_seed(0)
    out = EngineRollout()(model, prompts, _gc(do_sample=True, max_new_tokens=6), record=True)
    ids, mask = _rows(prompts, out.completion_ids)
    seen = []
    handles = [m.register_forward_pre_hook(lambda mod, a: seen.append(a[1].clone())) for m in fp4_experts(model)]
    model.train()
    try:
        with use_hints(model, out.hints, mask) as report:
            model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    finally:
        model.eval()
        for h in handles:
            h.remove()
    assert report.hint_coverage > 0.9 and sum(report.elements.values()) > 0
    assert report.hint_flip_rate <= 1e-3, report.flip_rate_by_layer()
    has = (mask.bool() & ((mask.cumsum(1) - 1) < out.hints.lengths[:, None])).flatten()
    pos = (mask.cumsum(1) - 1).clamp(min=0, max=out.hints.routing.shape[1] - 1)
    for layer, top_k in enumerate(seen):
        recorded = out.hints.routing[:, :, layer].gather(1, pos[..., None].expand(-1, -1, top_k.shape[-1]))
        assert torch.equal(top_k[has].long(), recorded.flatten(0, 1)[has].long())


def _rows(prompts, completions):
    """Left-padded ids and mask of prompt + completion rows, as the trainer feeds them."""
    rows = [p + c for p, c in zip(prompts, completions, strict=True)]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, x in enumerate(rows):
        ids[r, width - len(x) :], mask[r, width - len(x) :] = torch.tensor(x), 1
    return ids, mask


def test_engine_records_every_site():
    """hint_sites experts_input + experts_hidden + kv: the engine rolls out (no fallback) and its HintBatch has the
    generate path's columns and shapes, with the same values up to summation order; training under use_hints with
    them reproduces the rollout's rounding at every site (its own nearest rounding agrees with the hinted one)."""
    model = _model(True, sites=SITES)
    assert unsupported_reason(model, require_cuda=False) is None
    assert isinstance(make_rollout(model, "engine"), EngineRollout)
    prompts = _prompts(model, (6, 4, 7))
    a = GenerateRollout()(model, prompts, _gc(), record=True)
    b = EngineRollout()(model, prompts, _gc(), record=True)
    assert a.completion_ids == b.completion_ids
    ha, hb = a.hints, b.hints
    assert ha.sites == hb.sites == SITES
    assert {k: (v.shape, v.dtype) for k, v in ha.to_inputs().items()} == {
        k: (v.shape, v.dtype) for k, v in hb.to_inputs().items()
    }
    for site in SITES[1:]:
        (bits_a, scale_a, g_a), (bits_b, scale_b, g_b) = ha.site_hints[site], hb.site_hints[site]
        assert bits_b.any() and (g_b > 0).any()
        assert (bits_a == bits_b).float().mean() > 0.999, site
        assert (scale_a == scale_b).float().mean() > 0.999, site
        torch.testing.assert_close(g_a, g_b, rtol=1e-5, atol=0)

    ids, mask = _rows(prompts, b.completion_ids)
    model.train()
    try:
        rates = {}
        for name, hints in (("engine", hb), ("corrupted", _flip_bits(hb))):
            with torch.no_grad(), use_hints(model, hints, mask) as report:
                model(input_ids=ids, attention_mask=mask)
            assert report.hint_coverage > 0.9
            assert all(elements > 1000 for _, elements in report.counts_by_site().values())
            rates[name] = report.flip_rate_by_site()
    finally:
        model.eval()
    print("flip rates by site:", rates)
    assert set(rates["engine"]) == set(SITES)
    assert all(rate <= 1e-3 for rate in rates["engine"].values()), rates
    assert all(rate > 0.3 for rate in rates["corrupted"].values()), rates  # the check sees misapplied hints


def _flip_bits(hints):
    """The same hints with every recorded mantissa bit inverted: the other neighbour wherever a value is off the grid."""
    sites = {site: (~bits, scale, g) for site, (bits, scale, g) in hints.site_hints.items()}
    return type(hints)(~hints.mantissa_bits, hints.block_scale, hints.global_scale, hints.routing, hints.lengths,
                       hints.fmt, hints.hint_layers, hints.token_ids, sites)  # fmt: skip


def test_engine_refuses_what_it_does_not_implement():
    model = _model(True)
    with pytest.raises(ValueError, match="rollout_engine='generate'"):
        EngineRollout()(model, _prompts(model), _gc(no_repeat_ngram_size=2))
    with pytest.raises(ValueError, match="num_beams"):
        EngineRollout()(model, _prompts(model), _gc(num_beams=2))
    with pytest.raises(ValueError, match="num_beams"):
        GenerateRollout()(model, _prompts(model), _gc(num_beams=2))
    biased = T.tiny_model(
        num_hidden_layers=2, attention_bias=True
    ).eval()  # Qwen3.5: tests/rollout/test_qwen35_engine.py
    with pytest.raises(ValueError, match="cannot roll out"):
        make_rollout(biased, "engine")
    assert isinstance(make_rollout(biased, "auto"), GenerateRollout)
    assert isinstance(make_rollout(model, "auto"), GenerateRollout)  # CPU: auto means generate
    assert isinstance(make_rollout(model, "engine"), EngineRollout)  # ... unless asked (interpreter)


def test_engine_sees_data_updates():
    """A `.data` edit of the masters (no optimizer, no version bump) reaches the engine's next rollout."""
    model = _model(True)
    prompts = _prompts(model)
    eng = EngineRollout()
    a = eng(model, prompts, _gc(max_new_tokens=2))
    for m in fp4_experts(model):
        m.down_proj.data.mul_(-3.0)
    model.lm_head.weight.data.mul_(-1.0)
    b = eng(model, prompts, _gc(max_new_tokens=2))
    c = GenerateRollout()(model, prompts, _gc(max_new_tokens=2))
    assert b.completion_ids == c.completion_ids and b.completion_ids != a.completion_ids


def test_trainer_rolls_out_through_the_engine(tmp_path, engine_grpo_step, engine_grpo_metrics):
    from transformers import AutoModelForCausalLM

    path = T.save_tiny_model(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 quantization_config=TraceFP4Config(hint_layers=2))  # fmt: skip
    trainer, logged, changed = engine_grpo_step(model)
    assert isinstance(trainer.rollout, EngineRollout)
    for key in engine_grpo_metrics:
        assert key in logged, key
    assert any("experts" in n for n in changed) and any("q_proj" in n for n in changed)


@pytest.mark.gpu
def test_engine_graphs_match_eager_gpu():
    """On the GPU: the captured step replays exactly what the eager step computes (same seed, same tokens), and
    the greedy engine's first tokens equal generate's (bf16: later tokens may part on near-ties)."""
    model = _model(True, "cuda")
    prompts = _prompts(model, (9, 3, 17, 5, 12))
    gc = _gc(do_sample=True, temperature=0.9, top_p=0.9, max_new_tokens=24)
    torch.manual_seed(3)
    a = EngineRollout(use_graphs=True)(model, prompts, gc, record=True)
    torch.manual_seed(3)
    b = EngineRollout(use_graphs=False)(model, prompts, gc, record=True)
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs
    assert torch.equal(a.hints.mantissa_bits, b.hints.mantissa_bits)
    g = GenerateRollout()(model, prompts, _gc(max_new_tokens=1))
    e = EngineRollout()(model, prompts, _gc(max_new_tokens=1))
    assert g.completion_ids == e.completion_ids


@pytest.mark.gpu
def test_engine_records_every_site_gpu():
    """On the GPU (bf16, the fused experts, CUDA graphs): the captured step records the same hints at every site as
    the eager one; generate (fused experts, FP4 cache) records every site in the same layout; training under the
    engine's hints agrees with the rollout's rounding at every site."""
    model = _model(True, "cuda", sites=SITES)
    prompts = _prompts(model, (9, 3, 17, 5, 12))
    gc = _gc(do_sample=True, temperature=0.9, max_new_tokens=12)
    torch.manual_seed(3)
    a = EngineRollout(use_graphs=True)(model, prompts, gc, record=True)
    torch.manual_seed(3)
    b = EngineRollout(use_graphs=False)(model, prompts, gc, record=True)
    assert a.completion_ids == b.completion_ids and a.hints.sites == SITES
    for site in SITES[1:]:
        for x, y in zip(a.hints.site_hints[site], b.hints.site_hints[site], strict=True):
            assert torch.equal(x, y), site
    g = GenerateRollout()(model, prompts, _gc(max_new_tokens=4), record=True).hints  # fused experts, FP4 cache
    assert g.sites == SITES and {k: v.shape[2:] for k, v in g.to_inputs().items()} == {
        k: v.shape[2:] for k, v in a.hints.to_inputs().items()
    }
    ids, mask = _rows(prompts, a.completion_ids)
    model.train()
    try:
        with torch.no_grad(), use_hints(model, a.hints.to("cuda"), mask.cuda()) as report:
            model(input_ids=ids.cuda(), attention_mask=mask.cuda())
    finally:
        model.eval()
    rates = report.flip_rate_by_site()
    print("engine hints on the GPU, flip rates by site:", rates)
    assert set(rates) == set(SITES) and all(r < 0.05 for r in rates.values()), rates
