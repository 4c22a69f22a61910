# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Frozen FP4 experts train through the rollout's fused kernels (`experts_kernel="triton"`, "auto" on CUDA): the
training forward is the eval (rollout) path bit for bit, and its backward gives the torch path's input and
routing-weight gradients up to summation order (fp32 under the interpreter: 1e-5 relative; bf16 on the GPU:
2e-2 and 1e-2), the latter from the very FP4 hidden the forward kernel used. Hints at experts_input reach the
kernels as codes; an experts_hidden guide falls back to the torch path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trace_hf import fp4
from trace_hf.hints.replay import Guide
from trace_hf.hints.report import MismatchReport
from trace_hf.quant.experts import TraceFP4Experts
from trace_hf.quant.sites import HintSite


pytest.importorskip("trace_hf.kernels.fp4_moe")
pytestmark = pytest.mark.usefixtures("one_thread")


def frozen(kernel, E=4, H=64, NI=32, seed=0, device="cpu", dtype=torch.float32, cache=False, activations="fp4"):
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(E, 2 * NI, H, generator=g) * 0.1).to(device, dtype)
    d = (torch.randn(E, H, NI, generator=g) * 0.1).to(device, dtype)
    return TraceFP4Experts(gu, d, nn.functional.silu, "nvfp4", activations, kernel=kernel, cache_qat_weights=cache,
                           frozen=True).train()  # fmt: skip


def routing(M, E, K, seed=1, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w, ids = torch.softmax(torch.randn(M, E, generator=g), -1).topk(K)
    return ids.to(device), (w / w.sum(-1, keepdim=True)).to(device, dtype)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def step(mod, x, ids, w):
    """Output, input gradient and routing-weight gradient of ``mod`` for the loss sum(y * r) (fixed r)."""
    xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = mod(xi, ids, wi)
    r = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y)
    (y.float() * r.float()).sum().backward()
    return y.detach(), xi.grad, wi.grad


def input_guide(x, rows, flip=True):
    """An experts_input guide whose hints are ``x``'s own codes, with the mantissa bits of ``rows`` flipped."""
    hints = fp4.extract_hints(fp4.quantize(x, "nvfp4", "row"))
    bits = hints.mantissa_bits.clone()
    if flip:
        bits[rows] ^= 0xFF
    has = torch.zeros(x.shape[0], dtype=torch.bool)
    has[rows] = True
    report = MismatchReport()
    hints = fp4.FP4Hints(bits, hints.block_scale, hints.global_scale)
    return Guide("experts_input", hints, has, int(has.sum()), 0, report, True)


@pytest.mark.parametrize("cache", [False, True])
def test_kernel_training_forward_is_the_rollout_and_its_gradients_the_torch_paths(cache):
    mod, ref = frozen("triton", cache=cache), frozen("torch", cache=cache)
    ids, w = routing(21, 4, 2)
    x = torch.randn(21, 64, generator=torch.Generator().manual_seed(2))
    y, dx, dw = step(mod, x, ids, w)
    y_ref, dx_ref, dw_ref = step(ref, x, ids, w)
    mod.eval()
    with torch.no_grad():
        assert torch.equal(y, mod(x, ids, w)), "training forward differs from the rollout's kernels"
    assert not torch.equal(y, y_ref)  # the kernels ran: another summation order than torch's
    assert rel(y, y_ref) < 1e-5
    assert rel(dx, dx_ref) < 1e-5 and dx.abs().sum() > 0
    assert rel(dw, dw_ref) < 1e-5 and dw.abs().sum() > 0
    assert not list(mod.parameters())


def test_dense_activations_w4a16():
    """activations="none": the kernels read the dense input and hidden (W4A16); same agreement."""
    mod, ref = frozen("triton", activations="none"), frozen("torch", activations="none")
    ids, w = routing(11, 4, 2)
    x = torch.randn(11, 64)
    for a, b in zip(step(mod, x, ids, w), step(ref, x, ids, w), strict=True):
        assert rel(a, b) < 1e-5


def identity_down(mod):
    """Packed W_down = [I; 0] per expert, exact in any dtype, so grad @ W_down[e] is grad's first I columns exactly."""
    e, h, ni = mod.num_experts, mod.hidden_dim, mod.intermediate_dim
    codes = torch.zeros(e, h, ni, dtype=torch.uint8)
    codes[:, :ni] = torch.eye(ni, dtype=torch.uint8) * 2  # E2M1 code 2 is 1.0
    scale = fp4.e4m3_encode(torch.ones(e, h, ni // 16))
    return fp4.FP4Tensor(fp4.pack_codes(codes), scale, torch.ones(e, 1, 1), "nvfp4")


def test_routing_weight_gradient_reads_the_forward_kernels_hidden():
    """dL/dw_k is <grad @ W_down[e], the FP4 hidden the forward kernel's down projection read>, to fp32 rounding. In
    bf16 a gate/up recomputed in backward rounds 1-2% of the hidden's codes the other way (the kernels accumulate in
    fp32): this case has such flips, and a gradient taken from a recomputed hidden misses by about 1e-2."""
    from trace_hf.kernels import fp4_moe

    mod = frozen("triton", dtype=torch.bfloat16)
    gu = mod.packed_weights()[0]
    mod.load_packed_weights(gu, identity_down(mod))
    ids, w = routing(21, 4, 2)  # fp32 routing weights: their gradient comes back in fp32
    x = torch.randn(21, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    y, dx, dw = step(mod, x, ids, w)
    r = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y)  # grad of y, as in `step`
    xq = fp4.quantize(x, "nvfp4", "row")
    _, hidden = fp4_moe.experts_from_quantized(xq, ids, w, gu, mod.packed_weights()[1], True, return_hidden=True)
    pos = hidden.positions().view(21, 2)
    h = hidden.q.dequantize()[pos]  # [T, k, I] fp32, slot order
    want = (r[:, None, :32].float() * h).sum(-1)
    assert dw.dtype == torch.float32 and want.abs().min() > 0
    torch.testing.assert_close(dw, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    # The case is one where a bf16 recompute of gate/up flips hidden codes.
    gate, up = torch.einsum("th,tkih->tki", xq.dequantize(torch.bfloat16), gu.dequantize(torch.bfloat16)[ids]).chunk(
        2, dim=-1
    )
    recomputed = fp4.quantize(nn.functional.silu(gate) * up, "nvfp4", "row").codes()
    assert (recomputed != hidden.q.codes()[pos]).any()


def test_only_the_gradients_asked_for():
    """Input and routing-weight gradients alone are those of the full backward (which skips what is not asked for:
    the kept hidden without a routing-weight gradient, the gate/up recompute without an input gradient)."""
    mod = frozen("triton")
    ids, w = routing(13, 4, 2)
    x = torch.randn(13, 64)
    _, dx, dw = step(mod, x, ids, w)
    r = torch.randn(13, 64, generator=torch.Generator().manual_seed(3))
    xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    (mod(xi, ids, w) * r).sum().backward()
    (mod(x, ids, wi) * r).sum().backward()
    assert torch.equal(xi.grad, dx) and torch.equal(wi.grad, dw)


def test_no_grad_forward_equals_the_training_forward():
    """TRL's old log-prob forward (no grad, train mode) and the training forward compute the same bits."""
    mod = frozen("triton")
    ids, w = routing(9, 4, 2)
    x = torch.randn(9, 64)
    with torch.no_grad():
        a = mod(x, ids, w)
    assert torch.equal(a, step(mod, x, ids, w)[0])


def test_expert_parallel_sentinels_get_no_gradient():
    mod, ref = frozen("triton"), frozen("torch")
    ids, w = routing(8, 4, 2)
    ids[::3, 1] = 4  # another rank's expert
    x = torch.randn(8, 64)
    y, dx, dw = step(mod, x, ids, w)
    y_ref, dx_ref, dw_ref = step(ref, x, ids, w)
    assert rel(y, y_ref) < 1e-5 and rel(dx, dx_ref) < 1e-5 and rel(dw, dw_ref) < 1e-5
    assert (dw[::3, 1] == 0).all()


def test_input_hints_reach_the_kernels():
    """A flipped hint changes exactly its rows, as on the torch path, and the flips are counted alike."""
    ids, w = routing(12, 4, 2)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(4))
    rows = torch.tensor([1, 5, 6])
    outs, reports = {}, {}
    for kernel in ("triton", "torch"):
        mod = frozen(kernel)
        plain = step(mod, x, ids, w)
        guide = input_guide(x, rows)
        mod.sites["experts_input"] = HintSite("experts_input", 0, guide=guide)
        outs[kernel], reports[kernel] = (plain, step(mod, x, ids, w)), guide.report
    (plain, y), (_, y_ref) = outs["triton"], outs["torch"]
    other = torch.ones(12, dtype=torch.bool)
    other[rows] = False
    assert torch.equal(y[0][other], plain[0][other])
    assert (y[0][rows] != plain[0][rows]).any(dim=-1).all()
    for a, b in zip(y, y_ref, strict=True):
        assert rel(a, b) < 1e-5
    assert reports["triton"].total_flips == reports["torch"].total_flips > 0


def test_unflipped_hints_change_nothing():
    mod = frozen("triton")
    ids, w = routing(6, 4, 2)
    x = torch.randn(6, 64)
    plain = step(mod, x, ids, w)[0]
    mod.sites["experts_input"] = HintSite("experts_input", 0, guide=input_guide(x, torch.arange(6), flip=False))
    assert torch.equal(step(mod, x, ids, w)[0], plain)


def test_a_hidden_guide_runs_the_torch_path():
    """The kernels quantize the hidden activation inside: under an experts_hidden guide training takes the torch
    path, bit for bit the one of experts_kernel="torch"."""
    ids, w = routing(10, 4, 2)
    x = torch.randn(10, 64)
    h = torch.randn(10, 2, 32, generator=torch.Generator().manual_seed(5))
    hints = fp4.extract_hints(fp4.quantize(h, "nvfp4", "row"))
    got = []
    for kernel in ("triton", "torch"):
        mod = frozen(kernel)
        guide = Guide("experts_hidden", hints, torch.ones(10, dtype=torch.bool), 10, 0, MismatchReport(), True, ids)
        mod.sites["experts_hidden"] = HintSite("experts_hidden", 0, guide=guide)
        got.append(step(mod, x, ids, w))
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_kernel_training_on_cuda_gpu():
    """At prefill-sized slot counts (the wgmma kernels), bf16: the training forward is the rollout's, deterministic;
    output and gradients agree with the torch path computed in fp32 from the same codes (the bf16 torch path sits
    ~4% away in the output: its bf16 gate/up flip hidden FP4 codes that fp32 accumulation does not)."""
    kw = {"E": 16, "H": 512, "NI": 256, "device": "cuda", "dtype": torch.bfloat16}
    mod, ref = frozen("triton", **kw), frozen("torch", **kw).float()
    ids, w = routing(4096, 16, 4, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    a, b, c = step(mod, x, ids, w), step(mod, x, ids, w), step(ref, x.float(), ids, w.float())
    for u, v in zip(a, b, strict=True):
        assert torch.equal(u, v)
    with torch.no_grad():
        assert torch.equal(a[0], mod.eval()(x, ids, w))
    # Output and input gradient within 2e-2 on the H200 (h200_55). The routing-weight gradient measured 3.8e-2 there
    # while backward took it from a bf16 recompute of gate/up (1-2% of the hidden's FP4 codes rounded the other way);
    # it now reads the codes the forward kernel used, so what is left is bf16 rounding of W_down and grad @ W_down
    # (2^-9 each). This comparison on CPU (interpreter, 1024 of the 4096 tokens; command in docs/lab-notes.md 6a):
    # 3.4e-3 now, 3.8e-2 before (as on the GPU); output 1.7e-3, input gradient 6.0e-3. Hence 1e-2 (not yet GPU-run).
    bounds = {"output": 2e-2, "input gradient": 2e-2, "routing-weight gradient": 1e-2}
    errors = {name: rel(u, v) for name, u, v in zip(bounds, a, c, strict=True)}
    for name, e in errors.items():  # all three printed before any assertion
        print(f"kernel path against fp32 torch, {name}: relative error {e:.2e} (bound {bounds[name]:.0e})")
    assert all(errors[name] < bound for name, bound in bounds.items()), errors


@pytest.mark.filterwarnings(
    "ignore:divide by zero encountered in divide:RuntimeWarning"
)  # the interpreter, masked rows
def test_a_model_trains_alike_on_both_paths_under_hints_and_checkpointing(tmp_path):
    """A tiny frozen-experts model under `use_hints` (hints and routing recorded once): the loss and every gradient
    agree between the kernel and torch paths, the flips counted are the same, a no-grad forward scores the same
    loss bit for bit, and checkpointing's recompute reproduces the kernel path's gradients bit for bit."""
    from transformers import AutoModelForCausalLM

    from trace_hf import HintRecorder, TraceFP4Config, use_hints
    from trace_hf import testing as T

    path = T.save_tiny_model(tmp_path / "qwen3_moe", num_hidden_layers=2)

    def load(kernel):
        quant = TraceFP4Config(hint_layers=2, freeze_experts=True, experts_kernel=kernel)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=quant)

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(4, 100, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    rec_model = load("torch").eval()
    with torch.no_grad(), HintRecorder(rec_model) as rec:
        rec_model(input_ids=ids, attention_mask=mask)
    hints = rec.collect(mask)
    got = {}
    for kernel, ckpt in (("torch", False), ("triton", False), ("triton", True)):
        model = load(kernel).train()
        if ckpt:
            model.activation_checkpointing_enable({"use_reentrant": False})
        with torch.no_grad(), use_hints(model, hints, mask):  # TRL's old log-probs: no grad, train mode
            scored = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        with use_hints(model, hints, mask) as report:
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
            loss.backward()
        assert torch.equal(scored, loss.detach())  # so the first importance ratio is exactly 1
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        got[kernel, ckpt] = (loss.detach(), grads, report.total_flips)
    (l_t, g_t, f_t), (l_k, g_k, f_k), (l_c, g_c, _) = got.values()
    assert rel(l_k, l_t) < 1e-5 and f_k == f_t > 0
    assert g_k.keys() == g_t.keys() and any("router" in n or "gate.weight" in n for n in g_k)
    for n in g_t:
        assert rel(g_k[n], g_t[n]) < 1e-4, n
    assert torch.equal(l_c, l_k) and all(torch.equal(g_c[n], g_k[n]) for n in g_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["F.silu", "nn.SiLU", "ACT2FN", "gelu"])
def test_gated_activation_backward_is_autograds_bit_for_bit(dtype, act):
    """`gated_act_backward` (the frozen experts' backward through SiLU(gate) * up) writes what autograd computes, bit
    for bit, into one [R, 2I] tensor: SiLU by the same aten kernels, other activations through autograd itself."""
    from transformers.activations import ACT2FN

    from trace_hf.quant.expert_paths import gated_act_backward

    act_fn = {"F.silu": nn.functional.silu, "nn.SiLU": nn.SiLU(), "ACT2FN": ACT2FN["silu"], "gelu": nn.GELU()}[act]
    g = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(37, 2 * 24, generator=g) * 3).to(dtype)
    gate_up[0, :3] = torch.tensor([0.0, -0.0, 88.0])  # zero, signed zero, sigmoid saturated
    grad = torch.randn(37, 24, generator=g).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)  # strided views, as the grouped GEMM's output gives them
    got = gated_act_backward(act_fn, gate, up, grad)
    gl, ul = gate.detach().requires_grad_(True), up.detach().requires_grad_(True)  # the former code's leaves
    want = torch.cat(torch.autograd.grad(act_fn(gl) * ul, (gl, ul), grad), dim=-1)
    assert got.shape == (37, 48) and got.dtype == dtype
    assert torch.equal(got, want)
    if act != "gelu":  # SiLU takes the aten kernels, not autograd
        backward = torch.autograd.grad
        try:
            torch.autograd.grad = None
            assert torch.equal(gated_act_backward(act_fn, gate, up, grad), want)
        finally:
            torch.autograd.grad = backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_backward_reads_the_input_codes_as_the_dequantized_input(dtype):
    """`frozen_backward` given the input's FP4 codes (gathered by slot, then dequantized: a quarter of the bytes
    moved) gives the gradients it gives on the dequantized input, bit for bit."""
    from trace_hf.quant.expert_paths import frozen_backward

    mod = frozen("triton", dtype=dtype)
    ids, w = routing(19, 4, 2, dtype=dtype)
    x = torch.randn(19, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    q = fp4.quantize(x, "nvfp4", "row")
    grad = torch.randn(19, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    got = frozen_backward(mod, q, ids, w, grad, None, True, True, dtype)
    want = frozen_backward(mod, q.dequantize(dtype), ids, w, grad, None, True, True)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)
    assert got[0].abs().sum() > 0 and got[1].abs().sum() > 0


@pytest.mark.filterwarnings("ignore:divide by zero encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe_text"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_checkpointed_recompute_stops_before_experts_last_in_their_block(family, device, monkeypatch):
    """Under activation checkpointing, frozen experts that end their MoE block (Qwen3 MoE) keep what they save from
    the forward, so the recompute stops at the router and their kernels run once per training step; where the block
    computes more after them (Qwen3.5's shared-expert gate) they are recomputed as before. Either way the loss and
    every gradient are those of the run without checkpointing: bit for bit on Qwen3 MoE; on Qwen3.5 within 1e-6
    (transformers' torch Gated DeltaNet rule gives a checkpointed run ~1e-8 of its gradients another way, with or
    without this)."""
    from trace_hf import TraceFP4Config
    from trace_hf import testing as T
    from trace_hf.kernels import fp4_moe
    from trace_hf.quant.experts import fp4_experts
    from trace_hf.quant.quantizer import quantize_model

    calls = []
    run = fp4_moe.experts_from_quantized
    monkeypatch.setattr(fp4_moe, "experts_from_quantized", lambda *a, **k: calls.append(1) or run(*a, **k))
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    ids = torch.randint(4, 100, (2, 24), generator=torch.Generator().manual_seed(3)).to(device)
    got = {}
    for ckpt in (False, True):
        model = T.tiny_model(family, num_hidden_layers=2, dtype=dtype).to(device)
        model.set_attn_implementation("eager")  # deterministic on CUDA too (flash attention's dq is not)
        quantize_model(model, TraceFP4Config(freeze_experts=True, experts_kernel="triton", hint_layers=0))
        layers = len(fp4_experts(model))
        last = family == "qwen3_moe"
        assert layers == 2 and all(m.last_in_block == last for m in fp4_experts(model))
        model.train()
        if ckpt:
            model.activation_checkpointing_enable({"use_reentrant": False})
        calls.clear()
        loss = model(input_ids=ids, labels=ids).loss
        forward_calls = len(calls)
        loss.backward()
        assert forward_calls == layers and len(calls) == layers * (2 if ckpt and not last else 1), (ckpt, len(calls))
        got[ckpt] = loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    (l0, g0), (l1, g1) = got[False], got[True]
    assert torch.equal(l0, l1) and g0.keys() == g1.keys() and len(g0) > 0
    for n in g0:
        assert torch.equal(g0[n], g1[n]) if last else rel(g1[n], g0[n]) < 1e-6, n
