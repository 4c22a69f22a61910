# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The Triton kernels against the plain-torch specification, bit for bit.

Runs on CUDA when there is one, otherwise on CPU under TRITON_INTERPRET=1 (tests/conftest.py sets it). Every
comparison is on the bit view: codes, scale bytes, global scales and values must be identical, -0 included. The
one thing not compared is a NaN's payload (both sides must have a NaN in the same place): torch itself writes
different NaN bits on CPU and CUDA, and on CPU even for the same product depending on the vector width.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

from trace_hf import fp4
from trace_hf.kernels import fp4_quant as K


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The interpreter runs the kernels in numpy, which warns about the NaN/Inf lanes the kernels mask out.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def same_bits(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    if a.dtype.is_floating_point:
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        assert torch.equal(nan_a, nan_b), f"{what}: NaN in different places ({int((nan_a ^ nan_b).sum())})"
        ib = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a = torch.where(nan_a, torch.zeros_like(a), a).view(ib)
        b = torch.where(nan_b, torch.zeros_like(b), b).view(ib)
    if not torch.equal(a, b):
        bad = (a != b).nonzero()
        i = tuple(bad[0].tolist())
        raise AssertionError(f"{what}: {len(bad)} of {a.numel()} differ, first at {i}: {a[i]} vs {b[i]}")


def same_fp4(q: fp4.FP4Tensor, r: fp4.FP4Tensor, what: str = "") -> None:
    assert q.fmt == r.fmt
    same_bits(q.packed, r.packed, f"{what} packed codes")
    same_bits(q.block_scale, r.block_scale, f"{what} block scales")
    same_bits(q.global_scale, r.global_scale, f"{what} global scales")


def check_all(x: torch.Tensor, fmt: str, scale: str, hints_from: torch.Tensor | None = None) -> None:
    """quantize (+ hints), dequantize, fake-quant, guided quantize and guided fake-quant, kernel vs reference."""
    tag = f"{fmt}/{scale}/{x.dtype}/{tuple(x.shape)}"
    ref = fp4.quantize(x, fmt, scale, backend="torch")
    q, h = K.quantize(x, fmt, scale, return_hints=True)
    same_fp4(q, ref, tag)
    same_fp4(fp4.quantize(x, fmt, scale, backend="triton"), ref, tag + " via fp4.quantize")
    rh = fp4.extract_hints(ref)
    same_bits(h.mantissa_bits, rh.mantissa_bits, tag + " hint bits")
    same_bits(h.block_scale, rh.block_scale, tag + " hint scales")
    same_bits(h.global_scale, rh.global_scale, tag + " hint global")
    for dtype in {torch.float32, torch.bfloat16, x.dtype}:
        same_bits(K.dequantize(ref, dtype), ref.dequantize(dtype), f"{tag} dequantize {dtype}")
    same_bits(fp4.fake_quantize(x, fmt, scale, backend="triton"), ref.dequantize(x.dtype), tag + " fake-quant")
    # Guided: hints of x applied to a perturbed x (or to another tensor's hints).
    src = hints_from if hints_from is not None else x
    hints = fp4.extract_hints(fp4.quantize(src, fmt, scale, backend="torch"))
    xp = x.float() * (1 + 0.01 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x.device))
    xp = xp.to(x.dtype)
    gref = fp4.guided_quantize(xp, hints, backend="torch")
    same_fp4(fp4.guided_quantize(xp, hints, backend="triton"), gref, tag + " guided")
    same_bits(K.fake_quantize(xp, fmt, scale, hints=hints), gref.dequantize(x.dtype), tag + " guided fake-quant")
    check_hinted(xp, hints, tag)


def check_hinted(x: torch.Tensor, hints: fp4.FP4Hints, tag: str) -> None:
    """The one-pass hinted quantization (`fp4_hinted`) against its composed definition: codes, scales, values and
    flips, with hints on some rows, applied or only counted."""
    has = torch.rand(x.shape[:-1], generator=torch.Generator().manual_seed(2)).to(x.device) < 0.6
    for apply in (True, False):
        ref, ref_flips = fp4.hinted_quantize(x, hints, has, apply, backend="torch")
        q, flips = fp4.hinted_quantize(x, hints, has, apply, backend="triton")
        same_fp4(q, ref, f"{tag} hinted apply={apply}")
        v, v_flips = fp4.hinted_fake_quantize(x, hints, has, apply, backend="triton")
        same_bits(v, ref.dequantize(x.dtype), f"{tag} hinted values apply={apply}")
        assert flips.dtype == torch.int64 and int(flips) == int(ref_flips) == int(v_flips), tag


# ----------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------


def random_rows(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """N(0, 1) rows scaled by 1e-30..1e30, some blocks shrunk (E4M3 subnormal / flushed block scales), zeros,
    -0, all-zero blocks and rows, and a few rows poisoned by NaN or +-Inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x *= torch.pow(10.0, torch.empty(rows, 1).uniform_(-30, 30, generator=g))
    shrink = torch.pow(10.0, -torch.randint(0, 9, (rows, cols // 32), generator=g).float())
    shrink[torch.rand(shrink.shape, generator=g) < 0.7] = 1.0
    x *= shrink.repeat_interleave(32, dim=1)
    x[torch.rand(x.shape, generator=g) < 0.01] = 0.0
    x[torch.rand(x.shape, generator=g) < 0.01] = -0.0
    x[1, :32] = 0.0
    x[2] = 0.0
    x[3] = -0.0
    x[4, 5] = float("nan")
    x[5, 17] = float("inf")
    x[6, 40] = -float("inf")
    x[7, 3] = -float("nan")
    return x


def e4m3_values() -> torch.Tensor:
    """All finite non-negative E4M3 values, ascending."""
    return torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def e4m3_tie_rows(fmt_block: int = 16) -> torch.Tensor:
    """NVFP4 rows whose global scale is a power of two 2^k and whose blocks have amax = 6 * t * 2^k with t every
    E4M3 midpoint (subnormal ones, carries into the next binade, 448's neighbours) or a value next to one:
    ``(amax / 6) / g`` is then exactly t. The rest of each block holds E2M1 ties and grid points of its scale."""
    v = e4m3_values()
    mids = (v[1:] + v[:-1]) / 2
    ts = torch.cat([mids, torch.nextafter(mids, torch.zeros(1)), torch.nextafter(mids, torch.full((1,), 1e9)), v[1:]])
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.0, -0.0])
    rows = []
    for k in (-120, -60, -10, 0, 7, 40, 100):
        gk = 2.0**k
        blocks = [torch.cat([torch.tensor([2688.0 * gk]), torch.zeros(fmt_block - 1)])]
        for t in ts.tolist():
            sg = torch.tensor(t * gk)
            blk = torch.cat([torch.tensor([6.0]), ties * torch.where(torch.arange(15) % 2 == 0, 1.0, -1.0)])
            blocks.append((blk * sg).float())
        rows.append(torch.cat(blocks))
    return torch.stack(rows)


def e2m1_tie_rows(bs: int) -> torch.Tensor:
    """Blocks whose scale factor s * g is exactly 2^j, holding every E2M1 tie and grid point, both signs."""
    mags = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    vals = torch.tensor([6.0] + mags + [-m for m in mags] + [-0.0, 0.0])
    vals = torch.cat([vals, torch.zeros((-len(vals)) % bs)])
    rows = []
    for j in range(-40, 41, 5):
        rows.append(torch.cat([vals * 2.0**j, torch.tensor([2688.0 * 2.0**j]), torch.zeros(bs - 1)]))
    return torch.stack(rows)


# ----------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_quantize_with_hints_is_quantize_and_its_extracted_hints(device, backend):
    """`fp4.quantize_with_hints` (what the experts' input recording calls): `quantize`'s codes and the hints
    `extract_hints` takes from them, from the kernel's own bits on the Triton backend."""
    x = random_rows(24, 256, seed=11).to(device)
    q, h = fp4.quantize_with_hints(x, "nvfp4", "row", backend=backend)
    ref = fp4.quantize(x, "nvfp4", "row", backend="torch")
    same_fp4(q, ref, backend)
    rh = fp4.extract_hints(ref)
    for f in ("mantissa_bits", "block_scale", "global_scale"):
        same_bits(getattr(h, f), getattr(rh, f), f"{backend} {f}")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_million_random_values(device, fmt):
    x = random_rows(1024, 1024).to(device)  # 1,048,576 values
    ref = fp4.quantize(x, fmt, "row", backend="torch")
    q, h = K.quantize(x, fmt, "row", return_hints=True)
    same_fp4(q, ref, fmt)
    same_bits(h.mantissa_bits, fp4.extract_hints(ref).mantissa_bits, "hint bits")
    same_bits(K.dequantize(q), ref.dequantize(), "dequantize")
    same_bits(K.fake_quantize(x, fmt, "row"), ref.dequantize(), "fake-quant")
    xb = x.bfloat16()
    same_bits(K.fake_quantize(xb, fmt, "row"), fp4.quantize(xb, fmt, "row", backend="torch").dequantize(xb.dtype))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("scale", ["row", "tensor", "expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modes_shapes_dtypes(device, fmt, scale, dtype):
    x3 = random_rows(8 * 24, 256, seed=3).view(8, 24, 256)
    x3[2] = random_rows(24, 256, seed=4) * 1e-3  # a finite expert
    x3[5] = random_rows(24, 256, seed=5).nan_to_num(0.0, 0.0, 0.0)
    check_all(x3.to(device=device, dtype=dtype), fmt, scale)
    x2 = random_rows(40, 96, seed=6).nan_to_num(0.0, 0.0, 0.0)  # K not a power of two; finite tensor
    check_all(x2.to(device=device, dtype=dtype), fmt, scale)


def test_e4m3_ties_and_carries(device):
    x = e4m3_tie_rows().to(device)
    for scale in ("row", "tensor"):
        check_all(x, "nvfp4", scale)
    # The block-scale bytes really are the E4M3 RNE of the tie (ml_dtypes), not only equal to the reference's.
    q = K.quantize(x[3:4], "nvfp4", "row")  # g = 1
    v = e4m3_values()
    mids = ((v[1:] + v[:-1]) / 2).numpy()
    expect = mids.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(q.block_scale[0, 1 : 1 + len(mids)].cpu().numpy(), expect)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_e2m1_ties(device, fmt):
    bs = fp4.get_format(fmt).block_size
    x = e2m1_tie_rows(bs).to(device)
    check_all(x, fmt, "row")
    codes = K.quantize(x, fmt, "row").codes()[:, :29].cpu()
    expect = torch.tensor([7, 0, 2, 2, 4, 4, 6, 6, 1, 2, 3, 4, 5, 6, 7])
    expect = torch.cat([expect, expect[1:] | 8, torch.tensor([8, 0])])[:29]
    assert torch.equal(codes, expect.to(torch.uint8).expand_as(codes))


def test_zeros_and_signs(device):
    x = torch.zeros(4, 64, device=device)
    x[1] = -0.0
    x[2, 16:32] = -0.0
    x[3, :16] = torch.tensor([1.0] + [-0.0] * 15)
    for fmt in ("nvfp4", "mxfp4"):
        for scale in ("row", "tensor", "expert"):
            check_all(x, fmt, scale)
    q = K.quantize(x, "nvfp4")
    assert (q.codes()[1] == 8).all() and (q.block_scale[:3] == 0).all() and (q.global_scale[:3] == 0).all()


def test_block_scale_saturation_and_underflow(device):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 512, generator=g)
    # Blocks 1e-1 .. 1e-7 of the row amax: E4M3 subnormal block scales, then scales that flush to zero.
    x *= torch.pow(10.0, -torch.arange(32).float() % 8).repeat_interleave(16)
    x[:, 0] = 100.0
    # fp32 near-overflow rows (v rounds above 448 and saturates) and huge dynamic range
    x[10] *= 3e36
    x[11, 0] = 3.4e38
    check_all(x.to(device), "nvfp4", "row")
    check_all(x.to(device), "nvfp4", "tensor")
    q = K.quantize(x.to(device), "nvfp4")
    sb = q.block_scale.cpu()
    assert (sb == 0).any() and ((sb > 0) & (sb < 8)).any(), "expected flushed and subnormal block scales"


def test_fp32_subnormal_inputs(device):
    """Rows whose amax is an fp32 subnormal: g underflows (to 0 or a few ulps) and block scales saturate. On a GPU
    this also checks that nothing flushes subnormals to zero."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(32, 128, generator=g) * torch.pow(10.0, -torch.linspace(36, 45, 32)).unsqueeze(1)
    for fmt in ("nvfp4", "mxfp4"):
        for scale in ("row", "tensor"):
            check_all(x.to(device), fmt, scale)


def test_non_finite(device):
    x = random_rows(16, 128, seed=9).nan_to_num(0.0, 0.0, 0.0)
    x[0, 3] = float("nan")
    x[1, 100] = float("inf")
    x[2, 0] = -float("inf")
    x3 = x.view(4, 4, 128).clone()
    for fmt in ("nvfp4", "mxfp4"):
        for scale in ("row", "tensor", "expert"):
            check_all(x.to(device), fmt, scale)
            check_all(x3.to(device), fmt, scale)
    # Guided with the hints of a finite tensor applied to a poisoned one, and the other way around.
    clean = x.nan_to_num(0.0, 0.0, 0.0)
    check_all(x.to(device), "nvfp4", "row", hints_from=clean.to(device))
    check_all(clean.to(device), "nvfp4", "row", hints_from=x.to(device))
    d = K.dequantize(K.quantize(x.to(device), "nvfp4")).cpu()
    assert torch.isnan(d[:3]).all() and torch.isfinite(d[3:]).all()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_guided_with_arbitrary_hints(device, fmt):
    """Any hint bytes: random mantissa bits, every scale byte (NaN ones included), zero / NaN / Inf / subnormal
    global scales."""
    gen = torch.Generator().manual_seed(10)
    f = fp4.get_format(fmt)
    x = random_rows(64, 256, seed=11)
    bits = torch.randint(0, 256, (64, 32), generator=gen, dtype=torch.uint8)
    sb = torch.randint(0, 256, (64, 256 // f.block_size), generator=gen, dtype=torch.uint8)
    gs = torch.pow(10.0, torch.empty(64, 1).uniform_(-40, 30, generator=gen))
    gs[:4, 0] = torch.tensor([0.0, float("nan"), float("inf"), 1e-44])
    if not f.has_global_scale:
        gs = torch.ones(64, 1)
    hints = fp4.FP4Hints(bits.to(device), sb.to(device), gs.to(device), fmt)
    x = x.to(device)
    ref = fp4.guided_quantize(x, hints, backend="torch")
    same_fp4(K.guided_quantize(x, hints), ref, "guided")
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        r = fp4.guided_quantize(xd, hints, backend="torch").dequantize(dtype)
        same_bits(fp4.fake_quantize(xd, fmt, hints=hints, backend="triton"), r, f"guided fake {dtype}")
        check_hinted(xd, hints, f"arbitrary hints {fmt} {dtype}")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_hinted_in_one_pass(device, fmt, monkeypatch):
    """The one-pass kernel, not the composed fallback, on the three layouts the training sites use ([T, H],
    [T, top_k, I] and K/V's [T, 2, heads, D]), hints of a nearby tensor with some bits flipped at random; flips
    are counted on hinted rows only, and each row's values are the guided or the nearest ones."""
    import trace_hf.kernels.fp4_hinted as H

    gen = torch.Generator().manual_seed(13)
    for shape in ((64, 256), (8, 4, 128), (6, 2, 3, 64)):
        lead, k = shape[:-1], shape[-1]
        x = random_rows(int(torch.tensor(lead).prod()), k, seed=14).view(shape)
        h = fp4.extract_hints(fp4.quantize(x * 1.01, fmt, "row", backend="torch"))
        noise = torch.randint(0, 256, h.mantissa_bits.shape, generator=gen, dtype=torch.uint8)
        keep = torch.rand(noise.shape, generator=gen) < 0.7
        hints = fp4.FP4Hints(torch.where(keep, h.mantissa_bits, noise).to(device), h.block_scale.to(device),
                             h.global_scale.to(device), fmt)  # fmt: skip
        x = x.to(device)
        has = (torch.rand(lead, generator=gen) < 0.5).to(device)
        ref, ref_flips = fp4.hinted_quantize(x, hints, has, backend="torch")
        _, all_flips = fp4.hinted_quantize(x, hints, torch.ones_like(has), backend="torch")
        values = {}
        for dtype in (torch.float32, torch.bfloat16):
            xd, m = x.to(dtype), has.unsqueeze(-1)
            guided = fp4.guided_quantize(xd, hints, backend="torch").dequantize(dtype)
            values[dtype] = torch.where(m, guided, fp4.quantize(xd, fmt, "row", backend="torch").dequantize(dtype))
        with monkeypatch.context() as mp:
            mp.setattr(fp4, "compose_hinted", lambda *a, **kw: pytest.fail("took the composed path"))
            q, flips = H.hinted_quantize(x, hints, has)
            same_fp4(q, ref, f"{fmt} {shape}")
            assert 0 < int(flips) == int(ref_flips) < int(all_flips)
            for dtype, want in values.items():
                same_bits(H.hinted_fake_quantize(x.to(dtype), hints, has)[0], want, f"{fmt} {shape} values {dtype}")


def test_inputs_of_other_layouts(device):
    x = random_rows(64, 64, seed=12).nan_to_num(0.0, 0.0, 0.0).to(device)
    xt = x.t()  # not contiguous
    assert not xt.is_contiguous()
    check_all(xt, "nvfp4", "row")
    check_all(x.half(), "nvfp4", "row")
    check_all(x.half(), "mxfp4", "row")
    check_all(x.view(2, 2, 16, 64), "nvfp4", "expert")


class _SentinelTorch:
    """torch, whose ``empty`` fills what it allocates with a sentinel (NaN, or 0xAB bytes): shows what a kernel
    left unwritten."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else 0xAB)


@pytest.mark.parametrize("pad_rows", ["some", "all"])
def test_quantize_skips_padding_rows(device, pad_rows, monkeypatch):
    """``row_ids``: rows whose id is ``pad_id`` or more are left as allocated (the experts' padding, which nothing
    reads); every other row has the reference's bits, hints included. On the GPU, with two rows a program, whole
    programs of padding rows return early; "all" is that case in the interpreter too."""
    monkeypatch.setattr(K, "torch", _SentinelTorch())
    x = random_rows(48, 768, seed=21).to(device)
    ids = torch.randperm(48, generator=torch.Generator().manual_seed(22)).to(device=device, dtype=torch.int32)
    pad_id = 30 if pad_rows == "some" else 0
    q, h = K.quantize(x, "nvfp4", "row", return_hints=True, row_ids=ids, pad_id=pad_id)
    ref = fp4.quantize(x, "nvfp4", "row", backend="torch")
    real, pad = ids < pad_id, ids >= pad_id
    assert int(pad.sum()) == 48 - pad_id
    same_bits(q.packed[real], ref.packed[real], "codes")
    same_bits(q.block_scale[real], ref.block_scale[real], "scale bytes")
    same_bits(q.global_scale[real], ref.global_scale[real], "row scales")
    same_bits(h.mantissa_bits[real], fp4.extract_hints(ref).mantissa_bits[real], "hint bits")
    for t in (q.packed, q.block_scale, h.mantissa_bits):
        assert (t[pad] == 0xAB).all()
    assert torch.isnan(q.global_scale[pad]).all()


def test_row_ids_that_do_not_fit_are_an_error(device):
    x = torch.zeros(4, 32, device=device)
    ok = torch.zeros(4, dtype=torch.int32, device=device)
    for bad in (ok.long(), ok[:3]):
        with pytest.raises(ValueError, match="int32 tensor of one id per row"):
            K.quantize(x, row_ids=bad, pad_id=1)
    with pytest.raises(ValueError, match="scale='row'"):
        K.quantize(x, scale="tensor", row_ids=ok, pad_id=1)


def test_errors(device):
    with pytest.raises(ValueError, match="blocks of 16"):
        K.quantize(torch.zeros(4, 24, device=device))
    with pytest.raises(ValueError, match="blocks of 32"):
        K.fake_quantize(torch.zeros(4, 48, device=device), "mxfp4")
    with pytest.raises(ValueError, match="scale mode"):
        K.quantize(torch.zeros(4, 32, device=device), scale="block")
    with pytest.raises(ValueError, match="expert"):
        K.quantize(torch.zeros(32, device=device), scale="expert")
    h = fp4.extract_hints(fp4.quantize(torch.ones(4, 32), backend="torch"))
    with pytest.raises(ValueError, match="do not fit"):
        K.guided_quantize(torch.zeros(4, 64, device=device), h)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("guided", [False, True])
def test_straight_through_backward(device, backend, guided):
    x = torch.randn(4, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    hints = fp4.extract_hints(fp4.quantize(x.detach(), backend="torch")) if guided else None
    y = fp4.fake_quantize(x, hints=hints, backend=backend)
    up = torch.randn_like(y)
    y.backward(up)
    assert torch.equal(x.grad, up)


def test_cpu_without_interpreter_raises(tmp_path):
    code = (
        "import torch\nfrom trace_hf.kernels import fp4_quant\n"
        "try:\n    fp4_quant.quantize(torch.ones(2, 16))\nexcept RuntimeError as e:\n    print('RAISED', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # Outside the repository: there the cwd's trace_hf/ (without kernels/) would shadow the install.
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert "RAISED" in out.stdout and "TRITON_INTERPRET=1" in out.stdout and "CUDA" in out.stdout, out


def test_folder_does_not_import_as_top_level_kernels():
    """From the repository root (cwd on sys.path) `import kernels` gives the Hugging Face Kernels package where it is
    installed (transformers >= 5.25 depends on it) and at most a namespace shadow of kernels/ where it is not; either
    way none of kernels/'s modules load under the top-level name, and trace_hf.kernels is still ours."""
    code = (
        "import os, sys\nimport kernels\n"
        "assert not (getattr(kernels, '__file__', None) or '').startswith(sys.argv[1]), kernels.__file__\n"
        "try:\n    import kernels.fp4_quant\nexcept ImportError as e:\n    print('REFUSED', e)\n"
        "import trace_hf.kernels.fp4_quant as k\nprint('OURS', os.path.dirname(os.path.realpath(k.__file__)))\n"
    )
    root = os.path.realpath(ROOT)
    ours = os.path.join(root, "kernels") + os.sep
    out = subprocess.run([sys.executable, "-c", code, ours], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "REFUSED" in out.stdout, out
    assert f"OURS {os.path.join(root, 'kernels')}" in out.stdout, out


@pytest.mark.gpu
def test_reference_same_on_cuda_and_cpu():
    """The specification must not depend on the device it runs on (finite inputs; NaN payloads aside)."""
    x = random_rows(256, 512, seed=13)
    for fmt in ("nvfp4", "mxfp4"):
        for scale in ("row", "tensor"):
            a = fp4.quantize(x, fmt, scale, backend="torch")
            b = fp4.quantize(x.cuda(), fmt, scale, backend="torch")
            same_fp4(fp4.FP4Tensor(b.packed.cpu(), b.block_scale.cpu(), b.global_scale.cpu(), fmt), a, "cuda vs cpu")


def test_benchmark_smoke(tmp_path):
    out = tmp_path / "fp4_quant.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels.fp4_quant", "--smoke", "--out", str(out)],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["kernels"]) == {"quantize_with_hints", "guided_fake_quantize", "fake_quantize"}
    for fmt in ("nvfp4", "mxfp4"):
        assert not any(v for k, v in data["bit_exact"][fmt]["mismatches"].items() if not k.startswith("vs_cpu"))
