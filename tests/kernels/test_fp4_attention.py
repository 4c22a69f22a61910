# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""FP4 KV cache write (bit for bit against `trace_hf.fp4.quantize`) and split-K decode attention (against torch
attention over the dequantized cache, to fp32 rounding in the interpreter)."""

from __future__ import annotations

import pytest
import torch

from trace_hf import fp4


A = pytest.importorskip("trace_hf.kernels.fp4_attention")


def _rope_ref(x, pos, cos, sin):
    c, s = cos[pos.long()][:, None, :], sin[pos.long()][:, None, :]
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * c + rot * s


def _rms_ref(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("kv_fp4", [True, False])
def test_qkv_post_writes_the_cache(kv_fp4):
    torch.manual_seed(0)
    B, HQ, HKV, D, T = 3, 4, 2, 32, 20
    cache = A.allocate_kv_cache(B, HKV, T, D, kv_fp4, dtype=torch.float32, device="cpu")
    qkv = torch.randn(B, (HQ + 2 * HKV) * D) * 3
    qkv[0, HQ * D : (HQ + 1) * D] = 0.0  # a zero K row: g = 0, all codes 0
    pos = torch.tensor([0, 7, 19], dtype=torch.int32)
    qn, kn = torch.rand(D) + 0.5, torch.rand(D) + 0.5
    from trace_hf.rollout.engine import Dims, rope_tables

    cos, sin = rope_tables(Dims(64, HQ, HKV, D, 4, 2, 32, 16, 1), T, torch.float32, "cpu")
    q = A.qkv_post(qkv, cache, pos, HQ, HKV, qn, kn, cos, sin, 1e-6)
    q_in, k_in, v_in = qkv.split([HQ * D, HKV * D, HKV * D], dim=1)
    q_ref = _rope_ref(_rms_ref(q_in.view(B, HQ, D), qn, 1e-6), pos, cos, sin)
    k_ref = _rope_ref(_rms_ref(k_in.view(B, HKV, D), kn, 1e-6), pos, cos, sin)
    k_ref[0, 0] = 0.0
    assert torch.allclose(q, q_ref, rtol=1e-5, atol=1e-5)
    b = torch.arange(B)
    if kv_fp4:
        # The kernel quantizes its own (normalized, rotated) K: check the stored bits against the spec applied
        # to the kernel's K as seen by a no-norm, no-rope write of the same values.
        cache2 = A.allocate_kv_cache(B, HKV, T, D, True, dtype=torch.float32, device="cpu")
        qkv2 = torch.cat([q_in, k_ref.reshape(B, -1), v_in], dim=1)
        A.qkv_post(qkv2, cache2, pos, HQ, HKV)
        qk, qv = fp4.quantize(k_ref, "nvfp4", "row"), fp4.quantize(v_in.view(B, HKV, D), "nvfp4", "row")
        assert torch.equal(cache2.k[b, :, pos.long()], qk.packed)
        assert torch.equal(cache2.k_scale[b, :, pos.long()], qk.block_scale)
        assert torch.equal(cache2.k_g[b, :, pos.long()], qk.global_scale[..., 0])
        assert torch.equal(cache2.v[b, :, pos.long()], qv.packed)
        assert torch.equal(cache2.v_scale[b, :, pos.long()], qv.block_scale)
        assert torch.equal(cache2.v_g[b, :, pos.long()], qv.global_scale[..., 0])
        got = fp4.FP4Tensor(cache.k[b, :, pos.long()], cache.k_scale[b, :, pos.long()],
                            cache.k_g[b, :, pos.long()][..., None]).dequantize()  # fmt: skip
        assert torch.allclose(got, qk.dequantize(), rtol=0.2, atol=1e-3)  # rope/norm rounding may flip a code
        assert (cache.k[0, 0, 0] == 0).all() and cache.k_g[0, 0, 0] == 0
    else:
        assert torch.allclose(cache.k[b, :, pos.long()], k_ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(cache.v[b, :, pos.long()], v_in.view(B, HKV, D))


@pytest.mark.parametrize("kv_fp4", [True, False])
@pytest.mark.parametrize("HQ,HKV,splits", [(4, 2, (4, 64)), (8, 1, (1, 256)), (4, 4, (3, 128))])
def test_decode_attention_matches_reference(kv_fp4, HQ, HKV, splits):
    torch.manual_seed(1)
    B, D, T = 3, 32, 256
    cache = A.allocate_kv_cache(B, HKV, T, D, kv_fp4, dtype=torch.float32, device="cpu")
    K, V = torch.randn(B, HKV, T, D), torch.randn(B, HKV, T, D)
    Kd, Vd = A.fill_cache(cache, K, V)
    q = torch.randn(B, HQ, D)
    lengths = torch.tensor([1, 100, 256], dtype=torch.int32)
    out = A.decode_attention(q, cache, lengths, splits=splits)
    ref = A.attention_reference(q, Kd, Vd, lengths)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_decode_attention_at_a_batch_that_is_not_a_power_of_two():
    """The engine's row buckets past 64 are multiples of 64 (320 rows at 300); the combine launch takes a power-of-two
    number of rows per program whatever the batch (here B * HQ = 1,280, 5 x 256)."""
    torch.manual_seed(2)
    B, HQ, HKV, D, T = 40, 32, 4, 32, 16
    cache = A.allocate_kv_cache(B, HKV, T, D, True, dtype=torch.float32, device="cpu")
    Kd, Vd = A.fill_cache(cache, torch.randn(B, HKV, T, D), torch.randn(B, HKV, T, D))
    q = torch.randn(B, HQ, D)
    lengths = torch.randint(1, T + 1, (B,), dtype=torch.int32)
    out = A.decode_attention(q, cache, lengths, splits=(2, 16))
    assert torch.allclose(out, A.attention_reference(q, Kd, Vd, lengths), rtol=1e-4, atol=1e-5)


def test_default_splits_cover_the_cache():
    for B, H, T in [(1, 4, 32768 + 40), (64, 4, 1064), (16, 4, 8200)]:
        S, chunk = A.num_splits(B, H, T)
        assert (
            S * chunk >= T
            and (S - 1) * chunk < T
            and all(chunk % c["block_t"] == 0 for c in (A.CONFIG["fp4"], A.CONFIG["dense"]))
        )


def test_gluon_splits_are_the_fewest_that_reach_the_target():
    """The Gluon kernel's split count for 128-wide heads (``round_splits_up``): the fewest splits whose grid reaches
    ``target_programs``, unless the chunk floor or ``max_splits`` bounds it; the cache is covered in whole tiles.
    96 and 192 rows get 3 and 2 splits (1,152 and 1,536 programs), where rounding down gave 2 and 1 (768 each); the
    wide heads keep rounding down; the Triton kernels' rule is unchanged."""
    cfg = A.CONFIG["hopper"]
    for B in (1, 4, 20, 48, 64, 96, 128, 192, 256, 384, 512):
        want = -(-cfg["target_programs"] // (B * 4))  # the fewest splits that reach the target
        for T in (1064, 8448, 33024):
            S, chunk = A.num_splits(B, 4, T, True)
            bt = A.hopper_config(B, 128)["block_t"]
            assert S * chunk >= T and (S - 1) * chunk < T and chunk % bt == 0 and min(want, cfg["max_splits"]) >= S
            # the smallest whole-tile chunk that keeps to want splits, min_chunk and max_splits
            assert chunk - bt < max(cfg["min_chunk"], -(-T // want), -(-T // cfg["max_splits"])), (B, T, S, chunk)
    assert [A.num_splits(B, 4, 33024, True)[0] for B in (20, 64, 96, 128, 192, 256)] == [13, 4, 3, 2, 2, 1]
    wide = A.hopper_config(384, 256)
    assert not wide["round_splits_up"] and A.num_splits(384, 2, 33024, True, 256)[0] == wide["target_programs"] // 768
    assert A.num_splits(96, 4, 33024, False) == A.num_splits(96, 4, 33024)


def test_split_kernels_take_pdl_only_on_small_grids(monkeypatch):
    """Each split kernel's ``pdl_max_programs``: the step's launch options up to that many programs, none past it
    (0: never). As measured (h200_96): the Gluon FP4 kernel up to 128 (batch 1's 72 gained, batch 4's 256 lost);
    the BF16 kernel up to 16 (batch 1's 16 gained, batch 4's 64 lost); the unmeasured ones never."""
    on = {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(A, "launch_options", lambda device: on)
    cpu = torch.device("cpu")
    hopper, dense = A.CONFIG["hopper"], A.CONFIG["dense"]
    assert A.split_launch_options(72, hopper, cpu) == on and A.split_launch_options(128, hopper, cpu) == on
    assert A.split_launch_options(129, hopper, cpu) == {"PDL": False}
    assert A.split_launch_options(16, dense, cpu) == on and A.split_launch_options(64, dense, cpu) == {"PDL": False}
    assert A.split_launch_options(1, A.CONFIG["fp4"], cpu) == {"PDL": False}
    assert A.split_launch_options(1, A.hopper_config(1, 256), cpu) == {"PDL": False}  # wide heads: not measured
    assert A.split_launch_options(1, {}, cpu) == {"PDL": False}


@pytest.mark.gpu
@pytest.mark.parametrize("kv_fp4", [True, False])
def test_decode_attention_gpu(kv_fp4):
    torch.manual_seed(2)
    B, HQ, HKV, D, T = 4, 32, 4, 128, 5000
    cache = A.allocate_kv_cache(B, HKV, T, D, kv_fp4, dtype=torch.bfloat16, device="cuda")
    K = torch.randn(B, HKV, T, D, device="cuda")
    V = torch.randn(B, HKV, T, D, device="cuda")
    Kd, Vd = A.fill_cache(cache, K.bfloat16() if not kv_fp4 else K, V.bfloat16() if not kv_fp4 else V)
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([1, 777, 4096, 5000], dtype=torch.int32, device="cuda")
    out = A.decode_attention(q, cache, lengths)
    ref = A.attention_reference(q, Kd, Vd, lengths)
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2  # bf16 q and probabilities


@pytest.mark.gpu
def test_ptx_decoding_is_at_least_as_accurate_as_bf16_operands(monkeypatch):
    """The inline-PTX path (fp16 operands normalized per row) against the bf16-operand path, with K and V row
    magnitudes spread over 8 decades: both against fp32 attention over the same dequantized cache."""
    torch.manual_seed(3)
    B, HQ, HKV, D, T = 2, 32, 4, 128, 3000
    cache = A.allocate_kv_cache(B, HKV, T, D, True, device="cuda")
    mag = 10 ** torch.empty(B, HKV, T, 1, device="cuda").uniform_(-4, 4)
    K = torch.randn(B, HKV, T, D, device="cuda") * mag.clamp(max=1.0)  # scores stay O(1)
    V = torch.randn(B, HKV, T, D, device="cuda") * mag.flip(2)
    Kd, Vd = A.fill_cache(cache, K, V)
    q = torch.randn(B, HQ, D, device="cuda")
    lengths = torch.tensor([3000, 1234], dtype=torch.int32, device="cuda")
    ref = A.attention_reference(q, Kd, Vd, lengths)
    err = {}
    for ptx in (False, True):
        monkeypatch.setitem(A.CONFIG, "ptx", ptx)
        out = A.decode_attention(q, cache, lengths)
        err[ptx] = ((out - ref).norm() / ref.norm()).item()
    print(f"decode attention relative error: bf16 operands {err[False]:.2e}, PTX fp16 operands {err[True]:.2e}")
    assert err[True] < 2e-3 and err[True] <= err[False]


@pytest.mark.parametrize("dt", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_qkv_post_rounds_as_qwen35_ops(dt):
    """``round_like_torch`` with partial rotary against transformers' own Qwen3.5 ops (its RMSNorm with ``1 + w``
    and ``apply_rotary_pos_emb`` over the first R dims): Q and the stored K/V equal up to fp32 summation order (in
    bf16: all but a rare ulp); columns past q, k, v (the output gate) are not read. bf16 on the GPU only: the
    interpreter truncates fp32 to bf16 where the GPU rounds."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm, apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    dev = "cuda" if dt == torch.bfloat16 else "cpu"
    B, HQ, HKV, D, R, T = 3, 4, 2, 32, 8, 20
    cache = A.allocate_kv_cache(B, HKV, T, D, False, dtype=dt, device=dev)
    proj = (torch.randn(B, (2 * HQ + 2 * HKV) * D, generator=g) * 3).to(dev, dt)  # [q | k | v | gate]
    pos = torch.tensor([0, 7, 19], dtype=torch.int32, device=dev)
    qn, kn = Qwen3_5MoeRMSNorm(D, eps=1e-6).to(dev), Qwen3_5MoeRMSNorm(D, eps=1e-6).to(dev)
    with torch.no_grad():
        for m in (qn, kn):
            m.weight.copy_(torch.randn(D, generator=g) * 0.3)
    qn, kn = qn.to(dt), kn.to(dt)
    inv = 1.0 / (10000.0 ** (torch.arange(0, R, 2, dtype=torch.float) / R))
    emb = torch.cat([torch.arange(T, dtype=torch.float)[:, None] * inv] * 2, -1)
    cos, sin = emb.cos().to(dev, dt), emb.sin().to(dev, dt)
    q = A.qkv_post(proj, cache, pos, HQ, HKV, 1 + qn.weight.detach().float(), 1 + kn.weight.detach().float(), cos, sin,
                   1e-6, round_like_torch=True)  # fmt: skip
    q_in, k_in, v_in, _ = proj.split([HQ * D, HKV * D, HKV * D, HQ * D], 1)
    with torch.no_grad():
        c, s = cos[pos.long()][:, None], sin[pos.long()][:, None]  # [B, 1, R], unsqueezed over heads
        q_ref, k_ref = apply_rotary_pos_emb(qn(q_in.view(B, 1, HQ, D)).transpose(1, 2),
                                            kn(k_in.view(B, 1, HKV, D)).transpose(1, 2), c, s)  # fmt: skip
    b = torch.arange(B, device=dev)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dt == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    for got, want in ((q, q_ref[:, :, 0]), (cache.k[b, :, pos.long()], k_ref[:, :, 0])):
        assert got.dtype == dt and (dt == torch.float32 or (got == want).float().mean() > 0.98)
        torch.testing.assert_close(got, want, **tol)
    assert torch.equal(cache.v[b, :, pos.long()], v_in.view(B, HKV, D))
    with pytest.raises(ValueError, match="cos and sin must be"):
        A.qkv_post(proj, cache, pos, HQ, HKV, None, None, cos[:, :-1], sin[:, :-1])
