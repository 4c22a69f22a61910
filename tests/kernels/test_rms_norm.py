# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`trace_hf.kernels.rms_norm` against transformers' RMSNorm ops (`FusedRMSNorm.reference`): forward, the input's
and the weight's gradients, both weight forms, bf16 and fp32, on the interpreter and (gpu) compiled. The sums over a
row are the only ops in another order, so bf16 values agree but for rare last-place steps and fp32 ones to rounding."""

from __future__ import annotations

import pytest
import torch

from trace_hf.kernels.rms_norm import rms_norm
from trace_hf.train.rms_norm import FusedRMSNorm


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _case(dev, dtype, n, zero_centered, rows=(37, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*rows, n, generator=g) * 3).to(dev, dtype)
    w = torch.randn(n, generator=g) * 0.1 + (0.0 if zero_centered else 1.0)
    return x, torch.nn.Parameter(w.to(dev, dtype))


def _both(x, w, zero_centered, dy=None):
    """(output, input grad, weight grad) of the reference ops and of the kernels, for the same output gradient."""
    out = []
    for f in (FusedRMSNorm(w, 1e-6, zero_centered).reference, lambda t: rms_norm(t, w, 1e-6, zero_centered)):
        xi = x.detach().clone().requires_grad_()
        y = f(xi)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y) if dy is None else dy
        out.append((y, *torch.autograd.grad(y, (xi, w), dy)))
    return out


def _close_bf16(got, want, share):
    """Equal but for at most ``share`` of the elements, and those within one bf16 step (plus the weight's sums)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)
    assert (got != want).float().mean().item() <= share


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("n", [128, 2048, 96, 4100])
def test_bf16_matches_transformers_ops(dev, zero_centered, n):
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, w = _case(dev, torch.bfloat16, n, zero_centered)
    (y, dx, dw), (y2, dx2, dw2) = _both(x, w, zero_centered)
    _close_bf16(y2, y, 1e-3)
    _close_bf16(dx2, dx, 1e-3)
    # The weight's gradient: fp32 sums of the products against autograd's sums of bf16-rounded ones (over 185 rows).
    torch.testing.assert_close(dw2.float(), dw.float(), rtol=2e-2, atol=2e-3 * dw.float().abs().max().item())
    assert dw2.dtype == w.dtype


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_fp32_matches_transformers_ops(dev, zero_centered):
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, w = _case(dev, torch.float32, 160, zero_centered)
    for want, got in zip(*_both(x, w, zero_centered)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mixed_weight_dtype_promotes_as_transformers():
    """An fp32 weight on a bf16 input: transformers' ``weight * x̂.to(bf16)`` is fp32 (the zero-centred form casts back)."""
    x, _ = _case("cpu", torch.bfloat16, 64, False)
    w = torch.nn.Parameter(torch.randn(64) * 0.1 + 1)
    (y, dx, dw), (y2, dx2, dw2) = _both(x, w, False)
    assert y2.dtype == y.dtype == torch.float32 and dx2.dtype == torch.bfloat16
    torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-5)
    assert rms_norm(x, w, 1e-6, zero_centered=True).dtype == torch.bfloat16


@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")  # numpy, in the interpreter
def test_special_rows():
    """As transformers: zeros (rstd = eps^-1/2); a NaN (its row becomes NaN); an Inf (rstd 0: the Inf becomes NaN,
    the rest of its row 0); squares that overflow fp32 (the same); tiny values; a bf16 tie; a frozen weight (no
    weight gradient)."""
    n = 64
    x = torch.randn(8, n) * 3
    x[0] = 0
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3] = 3e38
    x[3, ::2] = -3e38
    x[4] = 1e-30
    x[5] = 1 + 2**-8  # a bf16 tie after normalization by 1
    x = x.to(torch.bfloat16)
    w = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16), requires_grad=False)
    want = FusedRMSNorm(w, 1e-6, False).reference(x)
    got = rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0, equal_nan=True)
    assert torch.equal(got.isnan(), want.isnan()) and got[1].isnan().all() and got[2].isnan().sum() == 1
    xi = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(rms_norm(xi, w, 1e-6), xi, torch.ones_like(x))
    assert dx.shape == x.shape and not dx[0].isnan().any() and dx[1].isnan().all()


def test_empty_and_refused_inputs():
    x, w = _case("cpu", torch.bfloat16, 32, False, rows=(0,))
    assert rms_norm(x, w, 1e-6).shape == (0, 32)
    with pytest.raises(ValueError, match="bf16 or fp32"):
        rms_norm(torch.randn(4, 32, dtype=torch.float16), w, 1e-6)
    with pytest.raises(ValueError, match="last dimension"):
        rms_norm(torch.randn(4, 16, dtype=torch.bfloat16), w, 1e-6)
