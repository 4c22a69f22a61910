# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The static decode step (`trace_hf.rollout.decode`) against the transformers model's eval path, fp32 on CPU.

The fast path is fed the sequence one token per step (teacher forcing) and its logits are compared with a
full-sequence forward of the transformers model: with `TraceFP4Config` (W4A4 experts, FP4 KV cache) for the FP4
path, the plain model for the BF16 path. Both are fp32 here, so they agree to fp32 rounding (measured ~4e-7
max relative); hints must equal the ones `HintRecorder` records from the transformers model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from trace_hf import TraceFP4Config
from trace_hf.quantizer import quantize_model
from trace_hf.testing import tiny_model


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_setup  # noqa: E402


fd = pytest.importorskip("trace_hf.rollout.decode")
pytest.importorskip("trace_hf.kernels.fp4_moe")


def _model(fp4: bool):
    model = tiny_model(num_hidden_layers=2)
    if fp4:
        quantize_model(model, TraceFP4Config())
    return model.eval()


def _rel_max(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("fp4", [True, False])
def test_fast_decode_matches_transformers(fp4):
    from trace_hf.hints import HintRecorder

    torch.manual_seed(0)
    model = _model(fp4)
    B, T = 2, 5
    toks = torch.randint(4, model.config.vocab_size, (B, T))
    with torch.no_grad():
        if fp4:
            with HintRecorder(model) as rec:
                ref = model(toks, use_cache=False).logits
            hb = rec.collect(torch.ones(B, T, dtype=torch.long))
        else:
            ref = model(toks, use_cache=False).logits
    dec = fd.FastDecoder(fd.weights_from_hf(model), B, T + 1, kv_fp4=fp4, use_ops=fp4)
    logits, bits, scales, gs = [], [], [], []
    for t in range(T):
        dec.tokens.copy_(toks[:, t])
        dec.step()
        logits.append(dec.logits.clone())
        h = dec.hints()
        bits.append(h.mantissa_bits)
        scales.append(h.block_scale)
        gs.append(h.global_scale[..., 0])
    out = torch.stack(logits, 1)
    rel = _rel_max(out, ref)
    print(f"max rel diff of logits ({'fp4' if fp4 else 'bf16'} path): {rel:.2e}")
    assert rel < 1e-5
    assert torch.equal(dec.positions, torch.full((B,), T, dtype=torch.int32))
    assert torch.equal(dec.tokens, out[:, -1].argmax(-1))
    if fp4:
        assert len(dec.hinted) == 1
        # [n_hinted, T, B, ...] against the recorder's [B, T, n_hinted, ...]
        assert torch.equal(torch.stack(bits, 1), hb.mantissa_bits.permute(2, 1, 0, 3))
        assert torch.equal(torch.stack(scales, 1), hb.block_scale.permute(2, 1, 0, 3))
        # The row scale is amax / 2688 of an input that differs from the model's in its last fp32 bits.
        assert torch.allclose(torch.stack(gs, 1), hb.global_scale.permute(2, 1, 0), rtol=1e-5, atol=0)


def test_decode_ops_match_torch():
    from trace_hf.kernels import decode_ops

    torch.manual_seed(3)
    res, add, w = torch.randn(5, 64), torch.randn(5, 3, 64), torch.rand(64) + 0.5
    want_res = res + add.sum(1)
    want = w * (want_res * torch.rsqrt(want_res.pow(2).mean(-1, keepdim=True) + 1e-6))
    out = decode_ops.add_rmsnorm(res, add, w, 1e-6)
    assert torch.allclose(res, want_res, atol=1e-6) and torch.allclose(out, want, rtol=1e-5, atol=1e-6)
    logits = torch.randn(7, 20)
    ids, tw = decode_ops.router_topk(logits, 4, True)
    p = torch.softmax(logits, -1)
    v, i = p.topk(4)
    assert torch.equal(ids.long().sort(-1).values, i.sort(-1).values)
    assert torch.allclose(tw.sort(-1).values, (v / v.sum(-1, keepdim=True)).sort(-1).values, rtol=1e-5)


def test_random_weights_share_and_count_bytes():
    dims = fd.Dims(64, 4, 2, 32, 8, 2, 32, 128, 2)
    dense = decode_setup.random_weights(dims, torch.float32, "cpu", fp4_experts=False)
    q = decode_setup.random_weights(dims, torch.float32, "cpu", fp4_experts=True, shared=dense)
    assert q.fp4_experts and not dense.fp4_experts
    assert q.layers[0].w_qkv is dense.layers[0].w_qkv
    assert [lw.hinted for lw in q.layers] == [False, True]
    b16, b4 = decode_setup.bytes_per_step(dense, 1, 0), decode_setup.bytes_per_step(q, 1, 0)
    assert b4["experts"] < b16["experts"] / 3


@pytest.mark.gpu
def test_graph_replay_matches_eager_gpu():
    dims = fd.Dims(256, 8, 2, 64, 16, 4, 128, 512, 3)
    w = decode_setup.random_weights(dims, torch.bfloat16, "cuda", fp4_experts=True)
    for hints in (True, False):
        dec = fd.FastDecoder(w, 4, 300, kv_fp4=True, record_hints=hints)
        decode_setup.fill_random_context(dec, 200)
        dec.step()
        eager_logits, eager_tokens = dec.logits.clone(), dec.tokens.clone()
        dec.positions.fill_(200)
        dec.tokens.copy_(torch.randint(0, 512, (4,), generator=torch.Generator().manual_seed(0)).cuda())
        decode_setup.fill_random_context(dec, 200)  # same seed: same cache and tokens as before the eager step
        dec.capture()
        dec.run()
        torch.cuda.synchronize()
        assert torch.equal(dec.tokens, eager_tokens)
        assert torch.allclose(dec.logits, eager_logits, rtol=1e-3, atol=1e-3)
        assert int(dec.positions[0]) == 201
