# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""A token count the kernels have not seen compiles nothing (kernels/README.md, "Token counts are not specialized").

Packed training forwards feed a new number of tokens every micro-batch. Triton would compile a kernel again for a
count whose divisibility by 16 it had not met yet (a 0.6-2 s stall in the middle of a step); the training side's
kernels take their counts unspecialized, so the first count compiles one variant and every later one reuses it.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from trace_hf import fp4
from trace_hf.quant.experts import TraceFP4Experts


pytestmark = pytest.mark.gpu

#: The first count compiles; the others are neither it nor of its divisibility by 16 (800 is a multiple of 16).
WARM, COUNTS = 800, (803, 817, 832, 851)


@contextlib.contextmanager
def triton_calls():
    """Inside the block: the Triton kernels that missed the in-memory cache (each a compile, or a disk load of a new
    variant), and how many launches there were."""
    knobs = pytest.importorskip("triton.knobs", reason="Triton's runtime hooks (triton.knobs) need Triton 3.4+")
    compiled, launches = [], []
    before = knobs.runtime.jit_cache_hook, knobs.runtime.launch_enter_hook

    def on_miss(*args, **kwargs):
        compiled.append(getattr(kwargs.get("fn"), "name", "?"))
        return False  # go on compiling (True would skip the launch)

    knobs.runtime.jit_cache_hook, knobs.runtime.launch_enter_hook = on_miss, lambda *a, **k: launches.append(1)
    try:
        yield compiled, launches
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.launch_enter_hook = before


def _rms_norm(m: int) -> None:
    from trace_hf.kernels.rms_norm import rms_norm

    x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rms_norm(x, w, 1e-6).float().sum().backward()


def _rope(m: int) -> None:
    from trace_hf.kernels.rope import rope

    x = torch.randn(1, 4, m, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = torch.randn(2, 1, m, 128, device="cuda", dtype=torch.bfloat16)
    rope(x, cos, sin).float().sum().backward()


def _hinted(m: int) -> None:
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    hints = fp4.extract_hints(fp4.quantize(x * 1.01, "nvfp4", "row"))
    has = torch.arange(m, device="cuda") % 3 != 0
    fp4.hinted_fake_quantize(x, hints, has, True)
    fp4.hinted_quantize(x, hints, has, True)


def _experts(m: int) -> None:
    """The frozen FP4 experts' training forward and input gradient (`freeze_experts`: the grouped path at 400 slots
    per expert)."""
    g = torch.Generator().manual_seed(0)
    E, H, NI, K = 4, 512, 256, 2
    gu = (torch.randn(E, 2 * NI, H, generator=g) * 0.05).to("cuda", torch.bfloat16)
    d = (torch.randn(E, H, NI, generator=g) * 0.05).to("cuda", torch.bfloat16)
    mod = TraceFP4Experts(gu, d, nn.functional.silu, "nvfp4", "fp4", frozen=True).train()
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w, ids = torch.softmax(torch.randn(m, E, device="cuda"), -1).topk(K)
    mod(x, ids, w.to(torch.bfloat16)).float().sum().backward()


def _recurrent_rule(m: int) -> None:
    from trace_hf.kernels.gated_delta_recurrent import recurrent_gated_delta_rule

    t = m // 8
    q, k = (torch.randn(1, t, 2, 64, device="cuda", requires_grad=True) for _ in range(2))
    v = torch.randn(1, t, 2, 64, device="cuda", requires_grad=True)
    decay = -torch.rand(1, t, 2, device="cuda").requires_grad_()
    beta = torch.rand(1, t, 2, device="cuda").requires_grad_()
    out, _ = recurrent_gated_delta_rule(q, k, v, decay, beta, use_qk_l2norm_in_kernel=True)
    out.sum().backward()


@pytest.mark.parametrize("op", [_rms_norm, _rope, _hinted, _experts, _recurrent_rule], ids=lambda f: f.__name__[1:])
def test_new_token_counts_compile_nothing(op):
    op(WARM)  # compiles what this process has not yet
    with triton_calls() as (compiled, launches):
        for m in COUNTS:
            op(m)
        torch.cuda.synchronize()
    assert launches, f"{op.__name__} launched no Triton kernel: nothing was tested"
    assert compiled == [], f"new token counts compiled {sorted(set(compiled))} again"
