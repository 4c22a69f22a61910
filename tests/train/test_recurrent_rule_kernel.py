# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`trace_hf.kernels.gated_delta_recurrent`: transformers' torch recurrent gated delta rule over whole sequences in
one launch, up to the fp32 summation order of its sums over Dk (interpreter on the CPU, bf16 on the GPU), and the
kernel `gated_delta_rule="recurrent"` computes its values with on CUDA."""

from __future__ import annotations

import pytest
import torch

from trace_hf.train.delta_rule import torch_rules


pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")


def _inputs(dev, dtype, B=2, T=13, hk=2, dk=16, hv=4, dv=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(B, T, hv, dv, generator=g)
    decay_log = -torch.rand(B, T, hv, generator=g) * 3  # exp(g) in (e^-3, 1]
    decay_log[0, 0] = 0.0  # no decay
    beta = torch.rand(B, T, hv, generator=g)
    return [t.to(dev, dtype) for t in (q, k, v, decay_log, beta)]


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("block_v", [32, 8])
def test_the_kernel_steps_as_transformers_torch_rule(dev, l2norm, block_v, monkeypatch):
    """Output and final state from a random initial state, with repeated key heads, value slices of one or several
    programs (``block_v``); and from no state, without keeping one."""
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as M

    from trace_hf.kernels import gated_delta
    from trace_hf.kernels.gated_delta_recurrent import recurrent_gated_delta_rule

    monkeypatch.setitem(gated_delta.CONFIG, "block_v", block_v)
    _, torch_recurrent = torch_rules(M)
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    inputs = _inputs(dev, dtype)
    state0 = torch.randn(2, 4, 16, 32, generator=torch.Generator().manual_seed(1)).to(dev)
    kw = {"use_qk_l2norm_in_kernel": l2norm}
    want, want_state = torch_recurrent(*inputs, initial_state=state0, output_final_state=True, **kw)
    got, got_state = recurrent_gated_delta_rule(*inputs, initial_state=state0, output_final_state=True, **kw)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dev == "cpu" else {"rtol": 2e-2, "atol": 2e-2}
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_state, want_state, **tol)
    assert not torch.equal(state0, got_state)  # the state moved
    want, _ = torch_recurrent(*inputs, **kw)
    got, none = recurrent_gated_delta_rule(*inputs, **kw)
    assert none is None
    torch.testing.assert_close(got, want, **tol)


def test_the_kernel_refuses_shapes_it_cannot_tile():
    from trace_hf.kernels.gated_delta_recurrent import recurrent_gated_delta_rule

    q, k, v, g, beta = _inputs("cpu", torch.float32, dv=24)
    with pytest.raises(ValueError, match="powers of two"):
        recurrent_gated_delta_rule(q, k, v, g, beta)


def test_recurrent_values_take_the_kernel_on_cuda(monkeypatch):
    """`recurrent_values` computes the recurrent values with the kernel where `_use_kernel` says (CUDA; here the
    interpreter stands in): a Qwen3.5 forward then calls it once per Gated DeltaNet layer, no chunked rule runs, the
    logits are the torch loop's up to summation order and every gradient is, to 1e-4 of its norm, the chunked form's
    that the torch loop's path takes straight through."""
    from trace_hf import testing as T
    from trace_hf.kernels import gated_delta_recurrent
    from trace_hf.train import delta_rule

    model = T.tiny_model("qwen3_5_moe_text", num_hidden_layers=2, linear_key_head_dim=16, linear_value_head_dim=16)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))

    def grads():
        out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out

    with delta_rule.recurrent_values(model):
        want = model(ids).logits
        want.sum().backward()
    want_grads = grads()
    calls, chunks = [], []
    kernel = gated_delta_recurrent.recurrent_gated_delta_rule
    monkeypatch.setattr(
        gated_delta_recurrent, "recurrent_gated_delta_rule", lambda *a, **k: calls.append(1) or kernel(*a, **k)
    )
    monkeypatch.setattr(delta_rule, "_use_kernel", lambda q: True)
    for mod in delta_rule.delta_rule_modules(model):  # the chunked rule `recurrent_values` wraps, counted
        monkeypatch.setattr(mod, "torch_chunk_gated_delta_rule", _counted(mod.torch_chunk_gated_delta_rule, chunks))
    with delta_rule.recurrent_values(model):
        got = model(ids).logits
        got.sum().backward()
    n_linear = sum(t == "linear_attention" for t in model.config.layer_types)
    assert len(calls) == n_linear > 0 and not chunks
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got_grads = grads()
    assert got_grads.keys() == want_grads.keys() and any("linear_attn" in n for n in got_grads)
    for n, g in want_grads.items():
        # ~3e-7 of the norm; the decay's parameters (A_log, dt_bias, in_proj_a) ~3e-5: the chunked form sums the
        # log decays in chunks and takes differences of them, the recurrence multiplies each step's decay
        assert (got_grads[n] - g).norm() <= 1e-4 * g.norm(), n


def _counted(fn, calls):
    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return counted


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("chunk, block_v, T", [(4, 8, 13), (32, 16, 13), (4, 32, 8), (8, 8, 1)])
@pytest.mark.parametrize("l2norm", [True, False])
def test_the_kernels_gradient_is_the_torch_rules(dev, chunk, block_v, T, l2norm, monkeypatch):
    """From a zero state the kernel is differentiable, with the gradient of transformers' torch recurrent rule for
    every input (q, k, v, the log decay, beta; key heads repeated), whatever the checkpoint spacing (``chunk``: one
    chunk, several, a partial last one) and the value slices (``block_v``: one program or several per head)."""
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as M

    from trace_hf.kernels import gated_delta_recurrent as R

    monkeypatch.setitem(R.BACKWARD, "chunk", chunk)
    monkeypatch.setitem(R.BACKWARD, "block_v", block_v)
    _, torch_recurrent = torch_rules(M)
    inputs = _inputs(dev, torch.float32, T=T)
    grad_out = torch.randn(2, T, 4, 32, generator=torch.Generator().manual_seed(5)).to(dev)
    got, want = [], []
    for rule, grads in ((R.recurrent_gated_delta_rule, got), (torch_recurrent, want)):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        out, _ = rule(*leaves, use_qk_l2norm_in_kernel=l2norm)
        (out * grad_out).sum().backward()
        grads += [out.detach()] + [t.grad for t in leaves]
    for name, a, b in zip(["out", "q", "k", "v", "g", "beta"], got, want, strict=True):
        assert a.shape == b.shape and (b.abs().sum() > 0 or (name == "g" and T == 1)), name  # no state to decay
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=name)


def test_the_kernel_refuses_a_gradient_from_an_initial_state():
    from trace_hf.kernels.gated_delta_recurrent import recurrent_gated_delta_rule

    q, k, v, g, beta = (t.requires_grad_(True) for t in _inputs("cpu", torch.float32))
    state0 = torch.randn(2, 4, 16, 32)
    with pytest.raises(NotImplementedError, match="initial state"):
        recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state0)
    with torch.no_grad():
        want, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    out, state = recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True)  # kept, without a gradient
    assert torch.equal(out, want) and torch.equal(state, want_state) and not state.requires_grad
    out.sum().backward()
    assert q.grad.abs().sum() > 0


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_row_lengths_step_each_rows_own_tokens(dev, monkeypatch):
    """With ``lengths`` (right-padded rows), each row's output, final state and every input's gradient at its own
    tokens are those of the row run alone, bit for bit; past its length the output and the gradients are zero
    (checkpoints every 4 tokens: rows ending inside a chunk, on its edge, after one token)."""
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from trace_hf.kernels import gated_delta_recurrent as R

    monkeypatch.setitem(R.BACKWARD, "chunk", 4)
    T, lengths = 13, [13, 8, 5, 1]
    inputs = _inputs(dev, torch.float32, B=4, T=T)
    grad_out = torch.randn(4, T, 4, 32, generator=torch.Generator().manual_seed(5)).to(dev)

    def run(xs, dout, n=None):
        leaves = [t.clone().requires_grad_(True) for t in xs]
        lens = None if n is None else torch.tensor(n, device=dev)
        out, state = R.recurrent_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True, output_final_state=True,
                                                  lengths=lens)  # fmt: skip
        (out * dout).sum().backward()
        return [out.detach(), state] + [t.grad for t in leaves]

    sizes = {}  # the backward's checkpoints and token slots: laid out for each row's own tokens, not the padding
    forward, padded_slots = R._forward, R._padded_slots

    def counting_forward(*args, ckpt=None, **kwargs):
        if ckpt is not None:
            sizes["checkpoints"] = ckpt.shape[0]
        return forward(*args, ckpt=ckpt, **kwargs)

    def counting_slots(lengths, heads, T, slots):
        sizes["slots"] = slots
        return padded_slots(lengths, heads, T, slots)

    monkeypatch.setattr(R, "_forward", counting_forward)
    monkeypatch.setattr(R, "_padded_slots", counting_slots)
    got = run(inputs, grad_out, lengths)
    assert sizes == {"checkpoints": 4 * sum(-(-n // 4) for n in lengths), "slots": 4 * sum(lengths)}, sizes
    for b, n in enumerate(lengths):
        alone = run([t[b : b + 1, :n] for t in inputs], grad_out[b : b + 1, :n])
        for name, x, y in zip(["out", "state", "q", "k", "v", "g", "beta"], got, alone, strict=True):
            if name == "state":
                assert torch.equal(x[b : b + 1], y), name
                continue
            assert torch.equal(x[b : b + 1, :n], y), (name, b)
            assert not x[b, n:].any(), (name, b)
    with torch.no_grad():  # from an initial state: the state after the row's own tokens
        state0 = torch.randn(4, 4, 16, 32, generator=torch.Generator().manual_seed(1)).to(dev)
        _, s = R.recurrent_gated_delta_rule(*inputs, initial_state=state0, output_final_state=True,
                                            lengths=torch.tensor(lengths, device=dev))  # fmt: skip
        _, s1 = R.recurrent_gated_delta_rule(*[t[2:3, :5] for t in inputs], initial_state=state0[2:3],
                                             output_final_state=True)  # fmt: skip
        assert torch.equal(s[2:3], s1)
    with pytest.raises(ValueError, match="lengths must be"):
        R.recurrent_gated_delta_rule(*inputs, lengths=torch.tensor([1, 2], device=dev))


def test_packed_gated_deltanet_skips_the_padding_and_changes_nothing(monkeypatch):
    """A packed Qwen3.5 training forward with the kernel (the interpreter standing in for CUDA): each Gated DeltaNet
    layer's rule gets its rows' lengths, and logits and every gradient are bit for bit those of the rule stepping the
    padding too (`delta_rule.SKIP_ROW_PADDING` off)."""
    from trace_hf import testing as T
    from trace_hf.kernels import gated_delta_recurrent
    from trace_hf.train import delta_rule, packing

    model = T.tiny_model("qwen3_5_moe_text", num_hidden_layers=2, linear_key_head_dim=16, linear_value_head_dim=16)
    model.train()
    lengths = [3, 9, 6]
    ids = torch.randint(4, model.config.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    seen = []
    kernel = gated_delta_recurrent.recurrent_gated_delta_rule
    monkeypatch.setattr(gated_delta_recurrent, "recurrent_gated_delta_rule",
                        lambda *a, lengths=None, **k: seen.append(lengths) or kernel(*a, lengths=lengths, **k))  # fmt: skip
    monkeypatch.setattr(delta_rule, "_use_kernel", lambda q: True)

    def step(skip):
        monkeypatch.setattr(delta_rule, "SKIP_ROW_PADDING", skip)
        with delta_rule.recurrent_values(model), packing.packed_attention(model, lengths):
            logits = model(input_ids=ids, position_ids=positions).logits
            logits.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return logits.detach(), grads

    (a, ga), (b, gb) = step(True), step(False)
    n_linear = sum(t == "linear_attention" for t in model.config.layer_types)
    assert len(seen) == 2 * n_linear and seen[n_linear:] == [None] * n_linear
    assert all(s is not None and s.tolist() == lengths for s in seen[:n_linear])
    assert torch.equal(a, b) and ga.keys() == gb.keys() and any("linear_attn" in n for n in ga)
    for n in ga:
        assert torch.equal(ga[n], gb[n]), n
