# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The Gluon FP4-KV decode attention (`trace_hf.kernels.fp4_attention_hopper`, sm_90+) against fp32 attention over
the dequantized cache, and against the Triton kernel it replaces.

Gluon does not run in the interpreter, so the numerics are GPU tests. The kernel's operands are exact fp16 values
of the cache (times 2^-14) and per-row normalized Q and probabilities, so its error against fp32 attention is that of
fp16 Q and probabilities (~1e-4 relative), including when K and V row scales spread over many decades; the V test
data give every token its own block scales, so that a swap of the two tokens of a register would show. On the CPU the
kernel is compiled for sm_90, so CI catches one that no longer builds, spills or loses its tight loop.
"""

from __future__ import annotations

import pytest
import torch


A = pytest.importorskip("trace_hf.kernels.fp4_attention")


def _hopper():
    if not (torch.cuda.is_available() and A.uses_hopper_kernel(True, 128, "cuda")):
        pytest.skip("needs an sm_90+ GPU and Gluon")


def _rel(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.fixture(params=[(32, 0), (32, 3), (64, 2)], ids=["registers", "cp.async-3", "cp.async-2-bt64"])
def pipeline(request, monkeypatch):
    """Both ways tiles reach the registers: loads straight to registers (``stages`` 0, with the register prefetch)
    and the cp.async ring in shared memory (whose masked copies must zero-fill past a sequence's end), at both
    tiles the configs use."""
    block_t, stages = request.param
    cfg = dict(A.CONFIG["hopper"], block_t=block_t, stages=stages, small_batch=None)
    monkeypatch.setitem(A.CONFIG, "hopper", cfg)
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("HQ,HKV,D", [(32, 4, 128), (16, 2, 256), (4, 1, 128)])
def test_matches_fp32_attention_over_the_cache(HQ, HKV, D, pipeline):
    """Qwen3-30B-A3B heads, 256-wide heads (Qwen3.5-35B-A3B's full-attention layers) and a GQA group smaller than
    the MMA's 8 columns."""
    _hopper()
    torch.manual_seed(0)
    B, T = 3, 3000
    cache = A.allocate_kv_cache(B, HKV, T, D, True, device="cuda")
    mag = 10 ** torch.empty(B, HKV, T, 1, device="cuda").uniform_(-4, 4)  # row scales over 8 decades
    K = torch.randn(B, HKV, T, D, device="cuda") * mag.clamp(max=1.0)  # scores stay O(1)
    V = torch.randn(B, HKV, T, D, device="cuda") * mag.flip(2)
    Kd, Vd = A.fill_cache(cache, K, V)
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([1, 1777, 3000], dtype=torch.int32, device="cuda")
    ref = A.attention_reference(q, Kd, Vd, lengths)
    for splits in (None, (1, 3072), (7, 448)):
        out = A.decode_attention(q, cache, lengths, splits=splits).float()
        # bf16 output: 2^-9 relative rounding on top of the kernel's own error
        assert _rel(out, ref) < 4e-3, splits
        assert torch.allclose(out[0], ref[0], rtol=1e-2, atol=1e-2)  # one token: exactly its V row, in bf16


@pytest.mark.gpu
def test_agrees_with_the_triton_kernel_and_keeps_fp32_accuracy(pipeline, monkeypatch):
    _hopper()
    torch.manual_seed(1)
    B, HQ, HKV, D, T = 2, 32, 4, 128, 2500
    cache = A.allocate_kv_cache(B, HKV, T, D, True, device="cuda")
    Kd, Vd = A.fill_cache(cache, torch.randn(B, HKV, T, D, device="cuda"), torch.randn(B, HKV, T, D, device="cuda"))
    q = torch.randn(B, HQ, D, device="cuda")  # fp32 output: no bf16 rounding
    lengths = torch.tensor([2500, 999], dtype=torch.int32, device="cuda")
    ref = A.attention_reference(q, Kd, Vd, lengths)
    gluon = A.decode_attention(q, cache, lengths)
    monkeypatch.setitem(A.CONFIG, "hopper", {})
    triton_out = A.decode_attention(q, cache, lengths)
    err_g, err_t = _rel(gluon, ref), _rel(triton_out, ref)
    print(f"relative error against fp32 attention: Gluon {err_g:.2e}, Triton PTX {err_t:.2e}")
    assert err_g < 1e-3 and err_g < 2 * err_t


@pytest.mark.gpu
def test_stale_rows_past_the_length_do_not_leak_and_nan_reaches_its_head_group(pipeline):
    """Cache rows past a sequence's length hold NaN scales (stale garbage): the output stays finite. A NaN scale at
    a valid V row makes exactly the query heads of that KV head NaN."""
    _hopper()
    torch.manual_seed(2)
    B, HQ, HKV, D, T = 2, 32, 4, 128, 700
    cache = A.allocate_kv_cache(B, HKV, T, D, True, device="cuda")
    Kd, Vd = A.fill_cache(cache, torch.randn(B, HKV, T, D, device="cuda"), torch.randn(B, HKV, T, D, device="cuda"))
    lengths = torch.tensor([300, 513], dtype=torch.int32, device="cuda")
    cache.k_scale[0, :, 300:] = 0x7F
    cache.v_scale[0, :, 300:] = 0x7F
    cache.v_scale[1, :, 513:] = 0xFF
    q = torch.randn(B, HQ, D, device="cuda")
    ref = A.attention_reference(q, Kd, Vd, lengths)
    out = A.decode_attention(q, cache, lengths)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-3
    cache.v_scale[1, 2, 100, 3] = 0x7F  # KV head 2 of sequence 1: query heads 16..23
    out = A.decode_attention(q, cache, lengths)
    nan_heads = torch.isnan(out).any(-1)
    assert nan_heads[1, 16:24].all() and not nan_heads[1, :16].any() and not nan_heads[1, 24:].any()
    assert not nan_heads[0].any()


@pytest.mark.gpu
def test_engine_splits_follow_the_kernel():
    _hopper()
    assert A.num_splits(64, 4, 32768, True)[0] > A.num_splits(64, 4, 32768, False)[0]


def test_small_batches_get_their_own_tile_and_splits_follow_it(monkeypatch):
    cfg = dict(A.CONFIG["hopper"], block_t=64, stages=2, small_batch={"max_batch": 4, "block_t": 32, "stages": 3})
    monkeypatch.setitem(A.CONFIG, "hopper", cfg)
    assert (A.hopper_config(4)["block_t"], A.hopper_config(4)["stages"]) == (32, 3)
    assert (A.hopper_config(5)["block_t"], A.hopper_config(5)["stages"]) == (64, 2)
    assert A.num_splits(1, 4, 1000, True)[1] % 32 == 0 and A.num_splits(64, 4, 1000, True)[1] % 64 == 0
    monkeypatch.setitem(A.CONFIG, "hopper", dict(cfg, small_batch=None))  # what the tune script sets: one tile
    assert A.hopper_config(1)["block_t"] == 64


def test_wide_heads_get_their_own_tile_and_programs(monkeypatch):
    """Heads of ``min_head_dim`` or more take the ``wide_heads`` settings, and small batches still their own tile."""
    wide = {"min_head_dim": 256, "block_t": 32, "stages": 2, "target_programs": 2112}
    cfg = dict(A.CONFIG["hopper"], block_t=64, target_programs=1056, wide_heads=wide,
               small_batch={"max_batch": 4, "block_t": 16, "stages": 3})  # fmt: skip
    monkeypatch.setitem(A.CONFIG, "hopper", cfg)
    assert (A.hopper_config(64, 128)["block_t"], A.hopper_config(64, 128)["target_programs"]) == (64, 1056)
    assert (A.hopper_config(64, 256)["block_t"], A.hopper_config(64, 256)["target_programs"]) == (32, 2112)
    assert A.hopper_config(2, 256)["block_t"] == 16
    assert A.num_splits(64, 2, 32768, True, 256)[0] >= A.num_splits(64, 2, 32768, True, 128)[0]
    assert A.num_splits(64, 2, 1000, True, 256)[1] % 32 == 0


def test_kernel_selection_without_gluon_or_gpu(monkeypatch):
    assert not A.uses_hopper_kernel(True, 128, "cpu")
    assert not A.uses_hopper_kernel(False, 128, "cpu")
    for B, H, T in [(1, 4, 32768 + 40), (64, 4, 1064)]:
        for hopper in (False, True):
            S, chunk = A.num_splits(B, H, T, hopper)
            assert S * chunk >= T and (S - 1) * chunk < T
    assert not A.uses_hopper_kernel(True, 64, "cuda")  # heads narrower than the 16-word MMA tiles: Triton kernel
    monkeypatch.setitem(A.CONFIG, "hopper", {})
    assert not A.uses_hopper_kernel(True, 128, "cuda")  # an empty config turns it off before any device query


def test_kernel_compiles_for_sm90_without_spills(gluon_sass_counts):
    """The Gluon attention builds for sm_90 with a loop under 5 instructions per K/V element (the Triton kernel's:
    ~7), tensor-core MMAs in it, and no register spills."""
    (r,) = [r for r in gluon_sass_counts if r["kernel"] == "gluon attention"]
    ops = r["ops"]
    assert "LDL" not in ops and "STL" not in ops, f"spills: {ops}"
    assert ops.get("HMMA", 0) > 0, "no tensor-core MMA in the loop"
    assert r["instructions"] / r["elements"] < 5.0, f"{r['instructions'] / r['elements']:.2f} instructions per element"
