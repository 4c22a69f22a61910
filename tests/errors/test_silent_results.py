# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""No silent wrong results: stale FP4 weights, beam search, use_hints in eval mode,
misaligned hints, routers replay cannot reproduce. Each case does the right thing or raises naming the fix."""

from __future__ import annotations

import math

import pytest
import torch

from trace_hf import TraceFP4Config
from trace_hf import testing as T
from trace_hf.hints import HintRecorder, MismatchReport, use_hints
from trace_hf.quant.experts import fp4_experts
from trace_hf.quant.freshness import refresh_fp4_weights
from trace_hf.quant.quantizer import quantize_model


pytestmark = pytest.mark.usefixtures("one_thread")


def _fp4(seed=0, **kw):
    model = T.tiny_model(seed=seed)
    quantize_model(model, TraceFP4Config(**{"hint_layers": 2, "experts_kernel": "torch", **kw}))
    return model.eval()


def _batch(model, lengths=(6, 4, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, width - n :] = torch.randint(4, model.config.vocab_size, (n,), generator=g)
        mask[r, width - n :] = 1
    return ids, mask


def _record(model, ids, mask, new=3):
    with torch.no_grad(), HintRecorder(model) as rec:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)  # fmt: skip
    full = torch.cat([mask, torch.ones(len(ids), new, dtype=mask.dtype)], 1)
    return out, full, rec.collect(full)


# 1. Stale FP4 weights -----------------------------------------------------------------------------------------


def test_data_edits_reach_generate_and_training():
    model, fresh = _fp4(), _fp4()
    ids, mask = _batch(model)
    with torch.no_grad():
        model(ids, attention_mask=mask)  # packs the weights
        for m in fp4_experts(model):
            m.down_proj.data.mul_(-2.0)  # no version bump, no optimizer step
        for m in fp4_experts(fresh):
            m.down_proj.mul_(-2.0)
        # An eval forward that starts a sequence (what generate does first) re-quantizes from the masters.
        assert torch.equal(model(ids, attention_mask=mask).logits, fresh(ids, attention_mask=mask).logits)
        for m in fp4_experts(model):
            m.down_proj.data.mul_(3.0)
        for m in fp4_experts(fresh):
            m.down_proj.mul_(3.0)
        # Training forwards use the refreshed QAT weights once refresh_fp4_weights is called.
        refresh_fp4_weights(model)
        model.train(), fresh.train()
        assert torch.equal(model(ids, attention_mask=mask).logits, fresh(ids, attention_mask=mask).logits)


def test_debug_mode_catches_stale_training_weights(monkeypatch):
    from trace_hf.quant import freshness

    monkeypatch.setattr(freshness, "DEBUG", True)
    model = _fp4()
    ids, mask = _batch(model)
    model.train()
    model(ids, attention_mask=mask)
    for m in fp4_experts(model):
        # One element off the strided sample that training forwards compare (whole-tensor writes are refreshed).
        assert m.gate_up_proj.numel() // 4096 > 1
        m.gate_up_proj.data.view(-1)[1] += 0.5
    with pytest.raises(RuntimeError, match="refresh_fp4_weights"):
        model(ids, attention_mask=mask)
    refresh_fp4_weights(model)
    model(ids, attention_mask=mask)


# 2. Beam search ----------------------------------------------------------------------------------------------


def test_beam_search_fp4_cache_matches_uncached_and_recorder_refuses():
    model = _fp4()
    ids, mask = _batch(model)
    kw = {"max_new_tokens": 4, "num_beams": 3, "do_sample": False, "pad_token_id": 0, "output_scores": True,
          "return_dict_in_generate": True}  # fmt: skip
    with torch.no_grad():
        cached = model.generate(input_ids=ids, attention_mask=mask, **kw)
        uncached = model.generate(input_ids=ids, attention_mask=mask, use_cache=False, **kw)
    assert torch.equal(cached.sequences, uncached.sequences)
    assert torch.allclose(cached.sequences_scores, uncached.sequences_scores, atol=1e-5)
    with torch.no_grad(), HintRecorder(model) as rec:
        model.generate(input_ids=ids, attention_mask=mask, **kw)
    with pytest.raises(RuntimeError, match="num_beams=1"):
        rec.collect(torch.ones(len(ids), ids.shape[1] + 4))


def test_recorder_refuses_uncached_and_repeated_generate():
    model = _fp4()
    ids, mask = _batch(model)
    with torch.no_grad(), HintRecorder(model) as rec:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, use_cache=False)
    with pytest.raises(RuntimeError, match="use_cache=True"):
        rec.collect(torch.ones(len(ids), ids.shape[1] + 3))
    with torch.no_grad(), HintRecorder(model) as rec:
        for _ in range(2):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    with pytest.raises(RuntimeError, match="per generate call"):
        rec.collect(torch.ones(len(ids), ids.shape[1] + 2))


# 3. use_hints in eval mode, reports over nothing ----------------------------------------------------------------


def test_use_hints_in_eval_raises_and_empty_report_is_nan():
    model = _fp4()
    ids, mask = _batch(model)
    out, full, hints = _record(model, ids, mask)
    with pytest.raises(RuntimeError, match="model.train"), use_hints(model, hints, full):
        pass
    r = MismatchReport()
    assert math.isnan(r.hint_flip_rate) and math.isnan(r.routing_mismatch) and math.isnan(r.hint_coverage)


# 4. Misaligned hints -----------------------------------------------------------------------------------------


def test_misaligned_hints_are_refused():
    model = _fp4()
    ids, mask = _batch(model, (6, 4, 5))
    out, full, hints = _record(model, ids, mask)
    seq = out
    other, _, _ = _record(model, *_batch(model, (6, 4, 5), seed=1))
    model.train()

    def forward(h, m, x):
        with use_hints(model, h, m):
            model(input_ids=x, attention_mask=m)

    forward(hints, full, seq)  # aligned: fine
    perm = torch.tensor([2, 0, 1])
    with pytest.raises(ValueError, match="differ from the ones the rollout recorded"):
        forward(hints[perm], full, seq)  # rows permuted, mask not
    with pytest.raises(ValueError, match="differ from the ones the rollout recorded"):
        forward(hints, torch.ones_like(full), seq)  # an all-ones mask over padded rows
    with pytest.raises(ValueError, match="differ from the ones the rollout recorded"):
        forward(hints, full, other)  # hints of other sequences
    mx = _fp4(fmt="mxfp4")
    mx.train()
    with pytest.raises(ValueError, match="mxfp4"), use_hints(mx, hints, full):
        pass


# 5. Routers replay cannot reproduce ------------------------------------------------------------------------------


def test_replay_refuses_unknown_routers():
    model = _fp4()
    ids, mask = _batch(model)
    out, full, hints = _record(model, ids, mask)
    model.train()
    for layer in model.model.layers:
        router = layer.mlp.gate
        router.__class__ = type("SigmoidRouter", (type(router),), {})
        del router.norm_topk_prob
    with pytest.raises(ValueError, match="routing_replay=False"), use_hints(model, hints, full):
        pass
    with use_hints(model, hints, full, routing_replay=False) as report:  # hints alone are still fine
        pass
    assert report.hint_coverage > 0.5
