# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The fused draw + log-prob (`gumbel_sample`) against its specification: the tokens of `draw(process_logits(x))`
bit for bit, the log-probs of `sampler_logprobs` to fp32 rounding, whatever the dtype, temperature, chunking or
rows; and the edge cases of the draw (excluded, NaN and lone tokens)."""

import pytest
import torch

from trace_hf.kernels import sampling as K
from trace_hf.rollout.sampling import SamplingSettings, draw, process_logits, sample, sampler_logprobs


def _reference(logits, s, seed, step, rows=None):
    raw = logits.float()
    tok = draw(process_logits(raw, s), s, seed, step, rows)
    return tok, sampler_logprobs(raw, tok, s)


def _logits(B, V, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, V, generator=g) * 4).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("V", [12, 2048, 5000])
def test_gumbel_sample_is_draw_and_logprob(device, dtype, temperature, V):
    s = SamplingSettings(max_new_tokens=1, temperature=temperature)
    logits = _logits(7, V, dtype, device)
    seed, step = torch.tensor([11], device=device), torch.tensor([3], device=device)
    tok, lp = K.gumbel_sample(logits, seed, step, 1.0 / temperature)
    want_tok, want_lp = _reference(logits, s, seed, step)
    assert torch.equal(tok, want_tok)
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)
    assert torch.equal(sample(logits, s, seed, step)[0], want_tok)  # `sample` takes the fused path here


def test_gumbel_sample_follows_the_row_and_not_the_chunking(device, monkeypatch):
    logits = _logits(6, 3000, torch.bfloat16, device, seed=1)
    seed, step = torch.tensor([5], device=device), torch.tensor([-1], device=device)
    tok, lp = K.gumbel_sample(logits, seed, step, 1 / 0.9)
    perm = torch.tensor([4, 0, 5, 2, 1, 3], device=device)
    ptok, plp = K.gumbel_sample(logits[perm], seed, step, 1 / 0.9, rows=perm)
    assert torch.equal(ptok, tok[perm]) and torch.equal(plp, lp[perm])
    monkeypatch.setattr(K, "CHUNK", 256)  # 12 chunks instead of 2: the same draws
    ctok, clp = K.gumbel_sample(logits, seed, step, 1 / 0.9)
    assert torch.equal(ctok, tok)
    torch.testing.assert_close(clp, lp, rtol=1e-6, atol=1e-6)


def test_gumbel_sample_edge_cases(device):
    V = 4100  # three chunks, the last one short
    x = _logits(4, V, torch.float32, device, seed=2)
    x[0, :] = float("-inf")
    x[0, 4099] = 1.5  # one token left (in the short chunk): drawn with log-prob 0
    x[1, ::2] = float("nan")  # NaN is never drawn
    x[2, :2048] = float("-inf")  # a chunk of excluded tokens
    seed, step = torch.tensor([0], device=device), torch.tensor([0], device=device)
    tok, lp = K.gumbel_sample(x, seed, step)
    assert tok[0] == 4099 and lp[0] == 0
    assert tok[1] % 2 == 1
    assert tok[2] >= 2048
    assert torch.equal(tok, K.gumbel_argmax(x, seed, step))
    s = SamplingSettings(max_new_tokens=1)
    torch.testing.assert_close(lp[2:], sampler_logprobs(x[2:], tok[2:], s), rtol=1e-5, atol=1e-5)


def test_gumbel_sample_frequencies(device):
    """Draws over many rows of the same logits follow softmax(logits / T)."""
    n, V, T = 4096, 10, 0.6
    base = torch.randn(1, V, generator=torch.Generator().manual_seed(3))
    logits = base.repeat(n, 1).to(device)
    tok, lp = K.gumbel_sample(logits, torch.tensor([9], device=device), torch.tensor([0], device=device), 1 / T)
    want = torch.softmax(base[0] / T, -1)
    freq = torch.bincount(tok.cpu(), minlength=V).float() / n
    assert (freq - want).abs().max() < 0.035, (freq, want)  # ~4 standard errors at n = 4096
    torch.testing.assert_close(lp.cpu(), want.log()[tok.cpu()], rtol=1e-5, atol=1e-5)


def test_sample_truncating_settings_take_the_reference_path(device):
    s = SamplingSettings(max_new_tokens=1, temperature=0.8, top_k=5)
    assert not s.temperature_only and SamplingSettings(max_new_tokens=1, temperature=0.8).temperature_only
    logits = _logits(3, 300, torch.bfloat16, device, seed=4)
    seed, step = torch.tensor([1], device=device), torch.tensor([2], device=device)
    tok, lp = sample(logits, s, seed, step)
    want_tok, want_lp = _reference(logits, s, seed, step)
    assert torch.equal(tok, want_tok) and torch.equal(lp, want_lp)
    assert torch.topk(logits.float(), 5).indices.eq(tok[:, None]).any(1).all()  # top-k applied


def test_gumbel_sample_rejects_bad_input(device):
    seed, step = torch.tensor([1], device=device), torch.tensor([2], device=device)
    with pytest.raises(ValueError, match="float \\[B, V\\] logits"):
        K.gumbel_sample(torch.zeros(2, 5, dtype=torch.int64, device=device), seed, step)
    with pytest.raises(ValueError, match="rows must be int64"):
        K.gumbel_sample(torch.zeros(2, 5, device=device), seed, step, rows=torch.arange(2, device=device).int())


@pytest.mark.gpu
def test_gumbel_sample_at_the_engine_shape():
    """Qwen3's vocabulary, 256 rows of bf16 logits (the rollout's decode step) on the GPU."""
    s = SamplingSettings(max_new_tokens=1, temperature=0.9)
    logits = _logits(256, 151936, torch.bfloat16, "cuda", seed=5)
    seed, step = torch.tensor([7], device="cuda"), torch.tensor([40], device="cuda")
    rows = torch.randperm(256, generator=torch.Generator().manual_seed(0)).cuda()
    tok, lp = K.gumbel_sample(logits, seed, step, 1 / 0.9, rows=rows)
    want_tok, want_lp = _reference(logits, s, seed, step, rows)
    assert torch.equal(tok, want_tok)
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-4)
