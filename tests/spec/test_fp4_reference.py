# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The plain-torch specification `trace_hf.fp4` on its own: scalar formats against ml_dtypes, containers,
error bounds, ties, zeros, NaN/Inf policy, and what hint-guided rounding buys."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_hf import fp4


E2M1_TIES = [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)]


def pow2_rows(vals: torch.Tensor, j: int, bs: int = 16) -> torch.Tensor:
    """A row whose NVFP4 scale factor s * g is exactly 2^j: a block holding ``vals`` (amax 6), then a block
    setting the row amax to 2688 * 2^j (so g = 2^j and that block's s = 448)."""
    assert vals.numel() % bs == 0 and vals.abs().max() == 6.0
    return torch.cat([vals, torch.tensor([2688.0]), torch.zeros(bs - 1)]) * 2.0**j


# ----------------------------------------------------------------------------------------------------------
# Scalar formats against ml_dtypes
# ----------------------------------------------------------------------------------------------------------


def test_e2m1_rounding_matches_ml_dtypes():
    g = torch.Generator().manual_seed(0)
    a = torch.cat([torch.rand(200_000, generator=g) * 6.0, torch.arange(0, 6.0001, 0.125), torch.tensor([6.0])])
    idx = fp4.e2m1_index(a)
    ours = torch.tensor(fp4.E2M1_VALUES)[idx.long()].numpy()
    theirs = a.numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(ours, theirs)
    assert (fp4.e2m1_index(torch.tensor([6.5, 100.0, float("inf")])) == 7).all()  # saturates


def test_e4m3_rounding_matches_ml_dtypes():
    v = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (v[1:] + v[:-1]) / 2
    g = torch.Generator().manual_seed(1)
    vals = torch.cat(
        [
            v,
            mids,
            torch.nextafter(mids, torch.zeros(1)),
            torch.nextafter(mids, torch.full((1,), 1e9)),
            torch.rand(500_000, generator=g) * 448.0,
            torch.pow(2.0, torch.empty(200_000).uniform_(-20, 8.8, generator=g)).clamp(max=448.0),
        ]
    )
    ours = fp4.e4m3_encode(vals).numpy()
    theirs = vals.numpy().astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(ours, theirs)
    assert fp4.e4m3_encode(torch.tensor([449.0, 1e30, float("inf")])).tolist() == [0x7E] * 3  # saturates
    assert fp4.e4m3_encode(torch.tensor([float("nan")])).item() == fp4.E4M3_NAN_BYTE
    assert torch.equal(fp4.e4m3_decode(fp4.e4m3_encode(v)), v)


def test_e2m1_decode_and_e8m0_decode():
    codes = torch.arange(16, dtype=torch.uint8)
    want = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(fp4.e2m1_decode(codes).numpy().view(np.int32), want.view(np.int32))  # -0 too
    b = torch.arange(255, dtype=torch.uint8)
    assert torch.equal(fp4.e8m0_decode(b), torch.tensor([2.0 ** (i - 127) for i in range(255)]))
    assert torch.isnan(fp4.e8m0_decode(torch.tensor([255], dtype=torch.uint8))).all()


# ----------------------------------------------------------------------------------------------------------
# Containers
# ----------------------------------------------------------------------------------------------------------


def test_pack_round_trips():
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    packed = fp4.pack_codes(codes)
    assert packed.shape == (3, 5, 32) and torch.equal(fp4.unpack_codes(packed), codes)
    assert fp4.pack_codes(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21  # element 0 in the low nibble
    bits = torch.randint(0, 2, (4, 64), generator=g, dtype=torch.uint8)
    pb = fp4.pack_bits(bits)
    assert pb.shape == (4, 8) and torch.equal(fp4.unpack_bits(pb), bits)
    assert fp4.pack_bits(torch.tensor([0, 1, 0, 0, 0, 0, 0, 1])).item() == 0x82  # element 8j+b at bit b


def test_hint_bytes():
    assert fp4.hint_bytes_per_row(2048) == 256 + 128 + 4
    assert fp4.hint_bytes_per_row(2048, "mxfp4") == 256 + 64
    q = fp4.quantize(torch.randn(3, 2048), backend="torch")
    assert fp4.extract_hints(q).nbytes_per_row() == 388


# ----------------------------------------------------------------------------------------------------------
# Quantization rules
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_every_e2m1_tie(fmt):
    bs = fp4.get_format(fmt).block_size
    mags = [t for t, _ in E2M1_TIES]
    vals = torch.tensor([6.0] + mags + [-m for m in mags])
    vals = torch.cat([vals, torch.zeros(bs - len(vals) % bs if len(vals) % bs else 0)])
    for j in (-30, -3, 0, 5, 30):
        x = pow2_rows(vals, j, bs)[None]
        codes = fp4.quantize(x, fmt, backend="torch").codes()[0, : 1 + 2 * len(mags)]
        want = [7] + [c for _, c in E2M1_TIES] + [c | 8 for _, c in E2M1_TIES]
        assert codes.tolist() == want, (fmt, j)


def test_nvfp4_scales():
    x = torch.randn(4, 64)
    q = fp4.quantize(x, backend="torch")
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.equal(q.global_scale, amax / 2688.0)
    blocks = x.unflatten(-1, (-1, 16)).abs().amax(-1)
    assert torch.equal(q.block_scale, fp4.e4m3_encode((blocks / 6) / q.global_scale))
    assert (q.block_scale == fp4.e4m3_encode(torch.tensor(448.0))).any(dim=-1).all()  # the amax block


def test_mxfp4_scale_rule():
    x = torch.tensor([[5.9] + [0.0] * 31, [8.0] + [0.0] * 31, [1e-40] + [0.0] * 31, [0.0] * 32])
    q = fp4.quantize(x, "mxfp4", backend="torch")
    assert q.block_scale.flatten().tolist() == [127 + 0, 127 + 1, 0, 0]  # 2^(floor(log2 amax) - 2), clamped
    assert torch.equal(q.global_scale, torch.ones(4, 1))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_negative_zero_and_zero_blocks(fmt):
    x = torch.zeros(3, 64)
    x[0] = -0.0
    x[1, :32] = torch.randn(32)
    x[1, 40] = -0.0
    q = fp4.quantize(x, fmt, backend="torch")
    c = q.codes()
    assert (c[0] == 8).all() and c[1, 40] == 8 and (c[2] == 0).all() and (c[1, 32:40] == 0).all()
    assert (q.block_scale[0] == 0).all() and (q.block_scale[2] == 0).all()
    d = q.dequantize()
    assert (d[0] == 0).all() and torch.signbit(d[0]).all() and not torch.signbit(d[2]).any()
    if fmt == "nvfp4":
        assert q.global_scale[0].item() == 0 and q.global_scale[2].item() == 0


def test_block_scale_saturation_and_underflow():
    x = torch.zeros(1, 64)
    x[0, 0] = 1.0  # row amax: this block's scale is 448
    x[0, 16] = 1e-3  # s = 1e-3 * 448 = 0.448: normal
    x[0, 32] = 1e-5  # s ~ 0.00448: E4M3 subnormal
    x[0, 48] = 1e-7  # s ~ 4.5e-5 < 2^-10: flushes to zero, block dequantizes to 0
    q = fp4.quantize(x, backend="torch")
    sb = q.block_scale[0].tolist()
    assert sb[0] == 0x7E and sb[1] >= 8 and 0 < sb[2] < 8 and sb[3] == 0
    d = q.dequantize()
    assert d[0, 48] == 0 and d[0, 32] != 0
    # A subnormal fp32 amax makes g round far from amax / 2688: the block scale saturates at 448.
    y = torch.zeros(1, 16)
    y[0, 0] = 5.5e-42  # amax / 2688 = 2.05e-45 rounds down to 1.4e-45, so (amax / 6) / g = 654
    qy = fp4.quantize(y, backend="torch")
    assert qy.block_scale.item() == 0x7E and torch.isfinite(qy.dequantize()).all()


@pytest.mark.parametrize("fmt,bs", [("nvfp4", 16), ("mxfp4", 32)])
def test_bad_shapes_name_the_block(fmt, bs):
    for shape in [(4, bs + 8), (bs // 2,), (3, 5)]:
        with pytest.raises(ValueError, match=f"blocks of {bs}"):
            fp4.quantize(torch.zeros(shape), fmt, backend="torch")
    with pytest.raises(ValueError, match=f"blocks of {bs}"):
        fp4.quantize(torch.tensor(1.0), fmt, backend="torch")


@pytest.mark.parametrize("scale", ["row", "tensor", "expert"])
def test_non_finite_poisons_its_group_only(scale):
    x = torch.randn(4, 3, 64)
    x[1, 2, 7] = float("nan")
    x[2, 0, 50] = float("inf")
    d = fp4.quantize(x, "nvfp4", scale, backend="torch").dequantize()
    if scale == "tensor":
        assert torch.isnan(d).all()
        return
    poisoned = torch.zeros(4, 3, dtype=torch.bool)
    if scale == "row":
        poisoned[1, 2] = poisoned[2, 0] = True
    else:
        poisoned[1] = poisoned[2] = True
    assert torch.isnan(d[poisoned]).all() and torch.isfinite(d[~poisoned]).all()
    # The other groups are exactly what they would be without the poisoned ones.
    clean = fp4.quantize(x[0:1], "nvfp4", scale, backend="torch").dequantize()
    assert torch.equal(d[0:1], clean)
    q = fp4.quantize(x, "nvfp4", scale, backend="torch")
    assert (q.codes()[poisoned] & 7 == 0).all() and (q.block_scale[poisoned] == fp4.E4M3_NAN_BYTE).all()


def test_mxfp4_non_finite_poisons_its_block():
    x = torch.randn(2, 96)
    x[0, 40] = -float("inf")
    x[1, 0] = float("nan")
    q = fp4.quantize(x, "mxfp4", backend="torch")
    d = q.dequantize()
    assert torch.isnan(d[0, 32:64]).all() and torch.isfinite(d[0, :32]).all() and torch.isfinite(d[0, 64:]).all()
    assert torch.isnan(d[1, :32]).all() and torch.isfinite(d[1, 32:]).all()
    assert q.block_scale[0, 1] == fp4.E8M0_NAN_BYTE and q.codes()[0, 40] == 8


# ----------------------------------------------------------------------------------------------------------
# Properties
# ----------------------------------------------------------------------------------------------------------


def _half_step(y: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 grid spacing around |y| (<= 6)."""
    a = y.abs()
    return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))


shapes = st.tuples(st.integers(1, 4), st.integers(1, 5), st.sampled_from([1, 2, 4]))


@settings(max_examples=60, deadline=None)
@given(shape=shapes, log_mag=st.floats(-30, 30), fmt=st.sampled_from(["nvfp4", "mxfp4"]), seed=st.integers(0, 999))
def test_property_error_bound(shape, log_mag, fmt, seed):
    a, b, nblk = shape
    bs = fp4.get_format(fmt).block_size
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(a, b, nblk * bs, generator=g) * 10.0**log_mag
    x *= torch.pow(10.0, torch.empty(a, b, nblk).uniform_(-3, 0, generator=g)).repeat_interleave(bs, -1)
    q = fp4.quantize(x, fmt, backend="torch")
    d = q.dequantize()
    sg = q.scales().repeat_interleave(bs, -1)
    normal = sg > 1e-37  # far from fp32 subnormals, where the scale itself loses bits
    y = x / sg
    bound = torch.maximum(_half_step(y.clamp(-6, 6)) * sg, (x.abs() - 6 * sg).clamp(min=0)) * (1 + 1e-6)
    ok = (d - x).abs() <= bound
    flushed = sg == 0
    assert (ok | ~normal).all() and ((d[flushed] == 0).all())
    # Sign is kept, codes of the dequantized values under the same scales are the same codes.
    assert torch.equal(torch.signbit(d), torch.signbit(x) & (d != 0) | (torch.signbit(x) & (d == 0)))
    h = fp4.extract_hints(q)
    again = fp4.guided_quantize(d, h, backend="torch")
    assert torch.equal(again.codes()[normal], q.codes()[normal])


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 8), nblk=st.integers(1, 6), log_mag=st.floats(-20, 20), seed=st.integers(0, 999))
def test_property_row_scale_is_row_local(rows, nblk, log_mag, seed):
    """A row's quantization does not depend on the other rows (what lets rollout and training agree)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, nblk * 16, generator=g) * 10.0**log_mag
    q = fp4.quantize(x, backend="torch")
    q0 = fp4.quantize(x[-1:], backend="torch")
    assert torch.equal(q.packed[-1:], q0.packed) and torch.equal(q.block_scale[-1:], q0.block_scale)
    assert torch.equal(q.global_scale[-1:], q0.global_scale)


# ----------------------------------------------------------------------------------------------------------
# Guided rounding
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eps", [1e-3, 3e-3, 1e-2])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_guided_rounding_reproduces_rollout_codes(eps, fmt):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(512, 1024, generator=g)
    q = fp4.quantize(x, fmt, backend="torch")
    xp = x * (1 + eps * torch.randn(x.shape, generator=g))
    guided = (fp4.guided_quantize(xp, fp4.extract_hints(q), backend="torch").codes() == q.codes()).float().mean()
    nearest = (fp4.quantize(xp, fmt, backend="torch").codes() == q.codes()).float().mean()
    print(f"{fmt} eps={eps:g}: guided {guided.item():.6f}, nearest {nearest.item():.6f}")
    assert guided >= 0.999
    assert nearest < 0.999 and nearest < guided


def test_guided_on_grid_values_stay_and_validates_hints():
    x = torch.tensor([[6.0, 4.0, -3.0, 0.5] + [0.0] * 12])
    q = fp4.quantize(x, backend="torch")
    h = fp4.extract_hints(q)
    flipped = fp4.FP4Hints(h.mantissa_bits ^ 0xFF, h.block_scale, h.global_scale)
    assert torch.equal(fp4.guided_quantize(x, flipped, backend="torch").codes(), q.codes())
    with pytest.raises(ValueError, match="do not fit"):
        fp4.guided_quantize(torch.zeros(2, 16), h, backend="torch")


def test_fake_quantize_is_straight_through():
    x = torch.randn(3, 32, requires_grad=True)
    y = fp4.fake_quantize(x, backend="torch")
    assert torch.equal(y, fp4.quantize(x.detach(), backend="torch").dequantize())
    up = torch.randn_like(y)
    y.backward(up)
    assert torch.equal(x.grad, up)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_guided_quantize_poisons_blocks_with_non_finite_values(fmt):
    x = torch.randn(3, 64)
    hints = fp4.extract_hints(fp4.quantize(x, fmt))
    y = x.clone()
    y[1, 5] = float("nan")
    y[2, 40] = float("-inf")
    out = fp4.guided_quantize(y, hints).dequantize()
    bs = fp4.get_format(fmt).block_size
    assert out[1, :bs].isnan().all() and out[2, 40 // bs * bs : (40 // bs + 1) * bs].isnan().all()
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1, bs:]).all()
    assert out.isnan().sum() == 2 * bs
