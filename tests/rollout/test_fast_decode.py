# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The static decode step (`trace_hf.rollout.engine`) against the transformers model's eval path, fp32 on CPU.

The fast path is fed the sequence one token per step (teacher forcing) and its logits are compared with a
full-sequence forward of the transformers model: with `TraceFP4Config` (W4A4 experts, FP4 KV cache) for the FP4
path, the plain model for the BF16 path. Both are fp32 here, so they agree to fp32 rounding (measured ~4e-7
max relative); hints must equal the ones `HintRecorder` records from the transformers model.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.rollout import decode_setup
from trace_hf import TraceFP4Config
from trace_hf.quant.quantizer import quantize_model
from trace_hf.testing import tiny_model


fd = pytest.importorskip("trace_hf.rollout.engine")
pytest.importorskip("trace_hf.kernels.fp4_moe")


def _model(fp4: bool):
    model = tiny_model(num_hidden_layers=2)
    if fp4:
        quantize_model(model, TraceFP4Config())
    return model.eval()


def _replayed_steps(w, batch: int, kv_fp4: bool, record_hints: bool) -> torch.Tensor:
    """Logits and tokens of four graph replays of a `FastDecoder` step over a random 200-token context."""
    dec = fd.FastDecoder(w, batch, 300, kv_fp4=kv_fp4, record_hints=record_hints)
    decode_setup.fill_random_context(dec, 200)
    dec.capture()
    steps = []
    for _ in range(4):
        dec.run()
        steps.append(torch.cat([dec.logits.float().flatten(), dec.tokens.float().flatten()]))
    torch.cuda.synchronize()
    return torch.stack(steps)


def _rel_max(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("fp4,B", [(True, 2), (False, 2), (True, 1)])  # batch 1: the projections run `gemv`
def test_fast_decode_matches_transformers(fp4, B):
    from trace_hf.hints import HintRecorder

    torch.manual_seed(0)
    model = _model(fp4)
    T = 5
    toks = torch.randint(4, model.config.vocab_size, (B, T))
    with torch.no_grad():
        if fp4:
            with HintRecorder(model) as rec:
                ref = model(toks, use_cache=False).logits
            hb = rec.collect(torch.ones(B, T, dtype=torch.long))
        else:
            ref = model(toks, use_cache=False).logits
    dec = fd.FastDecoder(fd.weights_from_hf(model), B, T + 1, kv_fp4=fp4)
    logits, bits, scales, gs = [], [], [], []
    for t in range(T):
        dec.tokens.copy_(toks[:, t])
        dec.step()
        logits.append(dec.logits.clone())
        bits.append(dec.hint_bits.clone())  # this step's hints, [n_hinted, B, ...]
        scales.append(dec.hint_scale.clone())
        gs.append(dec.hint_g.clone())
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [64, 96])
def test_add_rmsnorm_fp4_is_quantize_of_add_rmsnorm(dtype, H):
    """The fused norm + quantization of the experts' input: the same residual and output as `add_rmsnorm`, and codes,
    scales and hints equal to `quantize` of that output (and the torch reference), with a NaN row, a zero row and
    a saturating weight; with hint buffers, the hints land in them."""
    from trace_hf import fp4
    from trace_hf.kernels import decode_ops, fp4_quant

    g = torch.Generator().manual_seed(11)
    res = torch.randn(6, H, generator=g).to(dtype)
    add = torch.randn(6, 2, H, generator=g)
    add[1, 0, 3] = float("nan")
    add[2] = 0.0
    res[2] = 0.0
    w = (torch.rand(H, generator=g) + 0.5).to(dtype)
    w[7] = 1e4
    r1, r2 = res.clone(), res.clone()
    out = decode_ops.add_rmsnorm(r1, add, w, 1e-6)
    bufs = fp4.FP4Hints(torch.empty(6, H // 8, dtype=torch.uint8), torch.empty(6, H // 16, dtype=torch.uint8),
                        torch.empty(6, 1), "nvfp4")  # fmt: skip
    out2, q = decode_ops.add_rmsnorm_fp4(r2, add, w, 1e-6, hints=bufs)
    same = {"rtol": 0, "atol": 0, "equal_nan": True}  # row 1 is NaN
    torch.testing.assert_close(r2, r1, **same)
    torch.testing.assert_close(out2, out, **same)
    want, want_hints = fp4_quant.quantize(out, "nvfp4", "row", return_hints=True)
    ref = fp4.quantize(out.float(), "nvfp4", "row", backend="torch")
    assert torch.equal(q.packed, want.packed) and torch.equal(want.packed, ref.packed)
    assert torch.equal(q.block_scale, ref.block_scale) and q.block_scale is bufs.block_scale
    torch.testing.assert_close(q.global_scale, ref.global_scale, **same)
    assert torch.isnan(q.global_scale[1]).all() and (q.global_scale[2] == 0).all()
    assert torch.equal(bufs.mantissa_bits, want_hints.mantissa_bits)
    _, q3 = decode_ops.add_rmsnorm_fp4(res.clone(), add, w, 1e-6)  # no hint buffers
    assert torch.equal(q3.packed, q.packed) and torch.equal(q3.block_scale, q.block_scale)


def test_add_rmsnorm_fp4_rejects_what_it_cannot_quantize():
    from trace_hf import fp4
    from trace_hf.kernels import decode_ops

    with pytest.raises(ValueError, match="not a multiple of 16"):
        decode_ops.add_rmsnorm_fp4(torch.randn(2, 40), None, torch.ones(40), 1e-6)
    bad = fp4.FP4Hints(torch.empty(2, 8, dtype=torch.uint8), torch.empty(2, 4, dtype=torch.uint8), torch.empty(2),
                       "nvfp4")  # fmt: skip
    with pytest.raises(ValueError, match=r"hints.global_scale must be .* shape \[2, 1\]"):
        decode_ops.add_rmsnorm_fp4(torch.randn(2, 64), None, torch.ones(64), 1e-6, hints=bad)


def test_gemv_is_f_linear_for_one_row():
    from trace_hf.kernels import decode_ops

    g = torch.Generator().manual_seed(12)
    for N, K in [(128, 2048), (100, 300)]:  # the router's shape, and widths the tiles do not divide
        x, w = torch.randn(1, K, generator=g), torch.randn(N, K, generator=g)
        ref = torch.nn.functional.linear(x, w)
        assert ((decode_ops.gemv(x, w) - ref).abs().max() / ref.abs().max()).item() < 1e-6
    x = torch.randn(3, 64, generator=g)
    w = torch.randn(8, 64, generator=g)
    assert torch.equal(decode_ops.linear(x, w), torch.nn.functional.linear(x, w))  # more rows: F.linear
    with pytest.raises(ValueError, match=r"gemv takes x \[1, K\]"):
        decode_ops.gemv(x, w)


def test_gemv_early_tiles_change_no_bits(monkeypatch):
    """`GEMV` ``early_tiles`` only moves weight loads ahead of the PDL wait, ``x_bcast`` only the layout x is read
    in: the same FMAs in the same order, so the bits of the loop path, with K tiles that the tile width does not
    divide and more early tiles than K has."""
    from trace_hf.kernels import decode_ops

    monkeypatch.setitem(decode_ops.GEMV, "block_k", 128)
    g = torch.Generator().manual_seed(3)
    for N, K in [(100, 300), (16, 512)]:
        x, w = torch.randn(1, K, generator=g), torch.randn(N, K, generator=g)
        base = decode_ops.gemv(x, w)
        for early, bcast in [(1, False), (2, False), (3, False), (8, False), (0, True), (2, True)]:
            monkeypatch.setitem(decode_ops.GEMV, "early_tiles", early)
            monkeypatch.setitem(decode_ops.GEMV, "x_bcast", bcast)
            assert torch.equal(decode_ops.gemv(x, w), base), (N, K, early, bcast)
        monkeypatch.setitem(decode_ops.GEMV, "early_tiles", 0)
        monkeypatch.setitem(decode_ops.GEMV, "x_bcast", False)


def test_gemv_early_weights_load_before_the_pdl_wait():
    """``early_tiles`` in the sm_90 code (`sass_counts.gemv_early_counts`): every weight load of the early tiles
    (16-byte loads of 8 bf16) is issued ahead of the PDL wait and no x load is, and nothing spills (programs per SM:
    see `decode_ops.GEMV`; they depend on the Triton version); with ``x_bcast`` x takes no shared-memory round trip
    (half the barriers or fewer)."""
    from benchmarks.kernels import sass_counts

    plain, two, four, four_bcast = sass_counts.clean_python(
        "import json; from benchmarks.kernels import sass_counts as s; "
        "print(json.dumps([s.gemv_early_counts(e, b) for e, b in ((0, False), (2, False), (4, False), (4, True))]))"
    )
    assert not any(op.startswith("LDG") for op in plain["before_wait"]), plain["before_wait"]
    for early, r in ((2, two), (4, four), (4, four_bcast)):
        assert r["before_wait"].get("LDG.E.128") == early * r["tile_weights_per_thread"] // 8, r["before_wait"]
        assert {op for op in r["before_wait"] if op.startswith("LDG")} == {"LDG.E.128"}, r["before_wait"]
        assert r["spills"] == 0, r
    # x_bcast: x by 16-byte loads in the weights' layout, not 8-byte ones changed in layout through shared memory.
    assert "LDG.E.64" in four["after_wait"] and "LDG.E.64" not in four_bcast["after_wait"], (four, four_bcast)
    bars = [r["after_wait"]["BAR.SYNC.DEFER_BLOCKING"] for r in (four, four_bcast)]
    assert bars[1] <= bars[0] // 2, bars


@pytest.mark.gpu
def test_gemv_early_tiles_change_no_bits_gpu(monkeypatch):
    """The same on the GPU at Qwen3-30B-A3B's one-row products (QKV, o_proj, router; bf16), each launched under PDL
    right after the add + RMSNorm that writes its input, eagerly and in CUDA graph replays with new inputs (a load of
    x ahead of the wait would read the previous replay's)."""
    from trace_hf.kernels import decode_ops

    g = torch.Generator(device="cuda").manual_seed(5)
    for N, K in [(5120, 2048), (2048, 4096), (128, 2048)]:
        w = torch.randn(N, K, device="cuda", generator=g).bfloat16()
        res = torch.randn(1, K, device="cuda", generator=g).bfloat16()
        add = torch.randn(1, 1, K, device="cuda", generator=g).bfloat16()
        ln = torch.rand(K, device="cuda", generator=g).bfloat16() + 0.5
        runs = []
        for early, bcast in [(0, False), (1, False), (2, False), (4, False), (0, True), (4, True)]:
            monkeypatch.setitem(decode_ops.GEMV, "early_tiles", early)
            monkeypatch.setitem(decode_ops.GEMV, "x_bcast", bcast)
            r = res.clone()
            eager = decode_ops.gemv(decode_ops.add_rmsnorm(r, add, ln, 1e-6), w)
            r.copy_(res)
            decode_ops.gemv(decode_ops.add_rmsnorm(r, add, ln, 1e-6), w)  # compiled before the capture
            r.copy_(res)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = decode_ops.gemv(decode_ops.add_rmsnorm(r, add, ln, 1e-6), w)
            replays = []
            for _ in range(3):  # the norm adds `add` into r in place: each replay a new input
                graph.replay()
                replays.append(out.clone())
            torch.cuda.synchronize()
            runs.append(torch.cat([eager] + replays))
        assert all(torch.equal(runs[0], run) for run in runs[1:]), (N, K)
        assert torch.equal(runs[0][0], runs[0][1]) and not torch.equal(runs[0][1], runs[0][2])


@pytest.mark.gpu
@pytest.mark.parametrize("fp4", [True, False])
def test_gemv_early_tiles_decode_step_gpu(fp4, monkeypatch):
    """Graph replays of a batch-1 step (its QKV, o_proj and router products by `gemv`) give the same bits with
    `GEMV` ``early_tiles`` and ``x_bcast`` as without."""
    from trace_hf.kernels import decode_ops

    dims = fd.Dims(256, 8, 2, 64, 16, 4, 128, 512, 3)
    w = decode_setup.random_weights(dims, torch.bfloat16, "cuda", fp4_experts=fp4)
    runs = []
    for early, bcast in [(0, False), (4, False), (4, True)]:
        monkeypatch.setitem(decode_ops.GEMV, "early_tiles", early)
        monkeypatch.setitem(decode_ops.GEMV, "x_bcast", bcast)
        runs.append(_replayed_steps(w, 1, fp4, fp4))
    assert all(torch.equal(runs[0], run) for run in runs[1:])


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


def test_pdl_launch_options(monkeypatch):
    """Programmatic dependent launch only where it exists: CUDA sm_90+, not the interpreter, not switched off."""
    from trace_hf.kernels import pdl

    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "INTERPRETED", False)
    pdl._supported.cache_clear()
    cap = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: cap["value"])
    assert pdl.launch_options(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch_options(torch.device("cuda", 0)) == {"PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", True)
    # By the decode step's rows: past CONFIG["max_rows"] no PDL; outside a step, and with no cap, PDL.
    monkeypatch.setitem(pdl.CONFIG, "max_rows", 128)
    with pdl.for_rows(128):
        assert pdl.launch_options(torch.device("cuda", 0))["PDL"]
        with pdl.for_rows(256):
            assert pdl.launch_options(torch.device("cuda", 0)) == {"PDL": False}
        assert pdl.launch_options(torch.device("cuda", 0))["PDL"]  # the outer step's again
    assert pdl.launch_options(torch.device("cuda", 0))["PDL"]
    monkeypatch.setitem(pdl.CONFIG, "max_rows", None)
    with pdl.for_rows(512):
        assert pdl.launch_options(torch.device("cuda", 0))["PDL"]
    cap["value"] = (8, 9)
    pdl._supported.cache_clear()
    assert pdl.launch_options(torch.device("cuda", 0)) == {"PDL": False}
    pdl._supported.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("B,fp4", [(1, True), (4, True), (1, False), (4, False)])
def test_pdl_changes_no_bits_gpu(B, fp4, monkeypatch):
    """Dependent launches only start kernels earlier; each waits for its producer before it reads or writes. Graph
    replays with and without them give the same bits (a missing wait would read half-written buffers)."""
    from trace_hf.kernels import pdl

    dims = fd.Dims(256, 8, 2, 64, 16, 4, 128, 512, 3)
    w = decode_setup.random_weights(dims, torch.bfloat16, "cuda", fp4_experts=fp4)
    runs = []
    for on in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", on)
        runs.append(_replayed_steps(w, B, fp4, fp4))
    assert torch.equal(runs[0], runs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("setting", [{"early_weights": 1}, {"early_weights": 2, "maxnreg_down": 120}])
@pytest.mark.parametrize("fp4_hidden_hints", [True, False])
def test_early_down_weights_change_no_bits_gpu(setting, fp4_hidden_hints, monkeypatch):
    """Batch 1's down programs with ``early_weights`` read their expert ids and weights before their PDL wait: graph
    replays of the step (buffers reused across layers and steps) give the bits of the entry without it."""
    from trace_hf.kernels import fp4_moe_configs as configs

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs an sm_90+ GPU (the Gluon expert kernels)")
    dims = fd.Dims(256, 8, 2, 64, 16, 4, 768, 512, 3)  # expert width 768: down splits in 2 slices of 3 K tiles
    w = decode_setup.random_weights(dims, torch.bfloat16, "cuda", fp4_experts=True)
    base = list(configs.HOPPER)
    runs = []
    for patch in ({"early_weights": 0, "maxnreg_down": None}, setting):
        monkeypatch.setattr(configs, "HOPPER", [(base[0][0], dict(base[0][1], **patch))] + base[1:])
        runs.append(_replayed_steps(w, 1, True, fp4_hidden_hints))
    assert torch.equal(runs[0], runs[1])
