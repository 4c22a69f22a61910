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


def _load(device: str, kernel: bool, monkeypatch, D: int = 32) -> list:
    """The six decode-cache fields of two layers of head size ``D`` after `_load_cache` (rows of lengths 9, 4 and 12
    of P = 12)."""
    g = torch.Generator().manual_seed(0)
    B, H, P, T, B_max = 3, 2, 12, 16, 4
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
    rollout.EngineRollout._load_cache(SimpleNamespace(caches=caches), SimpleNamespace(layers=layers), lengths, P)
    return [getattr(c, n) for c in caches for n in ("k", "k_scale", "k_g", "v", "v_scale", "v_g")]


def _check(device, monkeypatch, D: int = 32):
    want, got = _load(device, False, monkeypatch, D), _load(device, True, monkeypatch, D)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("D", [32, 48])  # 48: code and scale widths (24, 3) that are not powers of two
def test_load_kernel_copies_the_cache_as_the_gathers_do(monkeypatch, D):
    _check("cpu", monkeypatch, D)


@pytest.mark.gpu
def test_load_kernel_copies_the_cache_as_the_gathers_do_gpu(monkeypatch):
    _check("cuda", monkeypatch)
