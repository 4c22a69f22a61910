# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`EngineRollout._load_cache` with `LOAD_KV_KERNEL` (one `decode_ops.load_fp4_kv` launch per FP4 layer) writes the
decode cache bit for bit as the torch gathers do: every row's left padding removed, the slots past the prompt and the
rows past the batch untouched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trace_hf.quant.kv_cache import FP4KVLayer
from trace_hf.rollout.engine import rollout


pytest.importorskip("trace_hf.kernels.decode_ops")


def _load(device: str, kernel: bool, monkeypatch, D: int = 32, src_rows=None) -> list:
    """The six decode-cache fields of two layers of head size ``D`` after `_load_cache` (prefill rows of lengths 9, 4
    and 12 of P = 12; with ``src_rows``, decode row b copies prefill row ``src_rows[b]``)."""
    g = torch.Generator().manual_seed(0)
    B, H, P, T, B_max = 3, 2, 12, 16, 6
    layers = []
    for _ in range(2):
        layer = FP4KVLayer()
        k, v = (torch.randn(B, H, P, D, generator=g).to(device) for _ in range(2))
        layer.update(k, v)
        layers.append(layer)
    caches = []
    for _ in layers:
        fields = {}
        for n in ("k", "v"):  # garbage where nothing must be written
            fields[n] = torch.randint(0, 256, (B_max, H, T, D // 2), generator=g, dtype=torch.uint8).to(device)
            fields[n + "_scale"] = torch.randint(0, 256, (B_max, H, T, D // 16), generator=g, dtype=torch.uint8).to(
                device
            )
            fields[n + "_g"] = torch.randn(B_max, H, T, generator=g).to(device)
        caches.append(SimpleNamespace(**fields))
    monkeypatch.setattr(rollout, "LOAD_KV_KERNEL", kernel)
    lengths = torch.tensor([9, 4, 12], device=device)
    if src_rows is not None:
        src_rows = torch.tensor(src_rows, device=device)
        lengths = lengths[src_rows]
    rollout.EngineRollout._load_cache(SimpleNamespace(caches=caches), SimpleNamespace(layers=layers), lengths, P,
                                      src_rows=src_rows)  # fmt: skip
    return [getattr(c, n) for c in caches for n in ("k", "k_scale", "k_g", "v", "v_scale", "v_g")]


def _check(device, monkeypatch, D: int = 32, src_rows=None):
    want, got = _load(device, False, monkeypatch, D, src_rows), _load(device, True, monkeypatch, D, src_rows)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return got


#: Five decode rows from three prefilled ones: rows that share a prompt repeat its row, in any order.
SHARED = [2, 0, 2, 1, 0]


@pytest.mark.parametrize("D", [32, 48])  # 48: code and scale widths (24, 3) that are not powers of two
def test_load_kernel_copies_the_cache_as_the_gathers_do(monkeypatch, D):
    _check("cpu", monkeypatch, D)


@pytest.mark.parametrize("D", [32, 48])
def test_load_kernel_copies_shared_rows_as_the_gathers_do(monkeypatch, D):
    """``src_rows`` (a prefill of each distinct prompt once): the kernel writes the bits of the torch gathers, and
    each decode row holds what the unshared load gives its prefill row."""
    got = _check("cpu", monkeypatch, D, SHARED)
    own = _load("cpu", True, monkeypatch, D)
    for shared, plain in zip(got, own, strict=True):
        for b, r in enumerate(SHARED):
            assert torch.equal(shared[b, :, :12].view(torch.uint8), plain[r, :, :12].view(torch.uint8))


def test_load_kernel_refuses_rows_without_a_source():
    from trace_hf.kernels.decode_ops import load_fp4_kv

    layer = FP4KVLayer()
    layer.update(torch.randn(2, 1, 4, 32), torch.randn(2, 1, 4, 32))
    dst = (torch.zeros(3, 1, 8, 16, dtype=torch.uint8), torch.zeros(3, 1, 8, 2, dtype=torch.uint8),
           torch.zeros(3, 1, 8), torch.zeros(3, 1, 8, 16, dtype=torch.uint8),
           torch.zeros(3, 1, 8, 2, dtype=torch.uint8), torch.zeros(3, 1, 8))  # fmt: skip
    with pytest.raises(ValueError, match="pass src_rows"):
        load_fp4_kv(dst, layer.fp4_keys, layer.fp4_values, torch.tensor([4, 4, 4]))


@pytest.mark.gpu
def test_load_kernel_copies_the_cache_as_the_gathers_do_gpu(monkeypatch):
    _check("cuda", monkeypatch)
    _check("cuda", monkeypatch, src_rows=SHARED)
