# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`trace_hf.kernels.rope` is transformers' ``apply_rotary_pos_emb`` bit for bit, forward and backward: full and
partial rotary (Qwen3 MoE, Qwen3.5), bf16 and fp32, q laid out as the attention transposes it, cos/sin broadcast
over rows (packed forwards), NaN and Inf; on the interpreter and (gpu) compiled."""

from __future__ import annotations

import importlib

import pytest
import torch

from trace_hf.kernels.rope import rope
from trace_hf.train.rope import MODULES


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _transformers_rope(name):
    try:
        return importlib.import_module(name).apply_rotary_pos_emb
    except ImportError:
        return None


def _operands(dev, dtype, b=2, h=3, t=5, d=32, r=32, cos_rows=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    # q as the attention makes it: [B, T, H, D] projected, viewed [B, H, T, D] (not contiguous).
    q = (torch.randn(b, t, h, d, generator=g) * 2).to(dev, dtype).transpose(1, 2)
    k = (torch.randn(b, t, 1, d, generator=g) * 2).to(dev, dtype).transpose(1, 2)
    pos = torch.arange(t, dtype=torch.float32)[:, None] * torch.rand(r // 2, generator=g)[None, :] * 3
    ang = torch.cat([pos, pos], -1).expand(cos_rows or b, t, r)
    return q, k, ang.cos().to(dev, dtype), ang.sin().to(dev, dtype)


def _layout(x):
    return [s for s, n in zip(x.stride(), x.shape) if n > 1]  # a size-1 dimension's stride says nothing


def _check(fn, q, k, cos, sin, contiguous=False):
    """Outputs and input gradients of transformers' function and of the kernel, compared exactly (NaN as NaN),
    and laid out alike in memory (what the attention after it, and reductions over the gradients, read)."""
    grads = [torch.randn(x.shape, generator=torch.Generator().manual_seed(i)).to(x) for i, x in enumerate((q, k))]
    results = []
    for f in (fn, lambda q, k, c, s: (rope(q, c, s, contiguous), rope(k, c, s, contiguous))):
        qi, ki = (x.detach().clone().requires_grad_() for x in (q, k))
        outs = f(qi, ki, cos, sin)
        results.append((*outs, *torch.autograd.grad(outs, (qi, ki), grads)))
    for want, got in zip(*results):
        assert got.dtype == want.dtype and got.shape == want.shape and _layout(got) == _layout(want)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    return results


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("module", sorted(MODULES))
def test_rope_is_transformers_bit_for_bit(dev, dtype, module):
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fn = _transformers_rope(module)
    if fn is None:
        assert "qwen3_moe" not in module and "qwen3_5_moe" not in module, "the target families' rope must exist"
        pytest.skip(f"{module} is not in this transformers")
    partial = MODULES[module]  # concatenates the passed channels back: a contiguous result
    _check(fn, *_operands(dev, dtype), contiguous=partial)  # full rotary
    if partial:  # partial rotary: the first quarter of each head rotates, the rest passes through
        _check(fn, *_operands(dev, dtype, d=64, r=16), contiguous=True)
    # cos/sin of one row broadcast over the batch (a packed forward's single sequence), odd head and token counts.
    _check(
        fn, *_operands(dev, dtype, b=3, h=5, t=7, d=48, r=48 if not partial else 24, cos_rows=1), contiguous=partial
    )


def test_rope_special_values():
    """NaN and Inf in q, signed zeros and a bf16 rounding tie in the products: as torch's ops give them."""
    fn = _transformers_rope("transformers.models.qwen3_moe.modeling_qwen3_moe")
    q, k, cos, sin = _operands("cpu", torch.bfloat16)
    q = q.contiguous()
    q[0, 0, 0, 0] = float("nan")
    q[0, 1, 1, 3] = float("inf")
    q[1, 2, 2, 5] = -0.0
    q[1, 0, 3] = 1 + 2**-7  # with cos = sin = 1 + 2**-7 the products need rounding ties
    cos[1, 3] = 1 + 2**-7
    sin[1, 3] = 1 + 2**-7
    _check(fn, q, k, cos, sin)


def test_rope_refuses_what_it_would_not_match():
    q, k, cos, sin = _operands("cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="apply_rotary_pos_emb"):
        rope(q, cos.float(), sin.float())  # cos of another dtype: transformers' ops promote
    with pytest.raises(ValueError, match="R even"):
        rope(q, cos[..., :3], sin[..., :3])
