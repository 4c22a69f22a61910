# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`TraceGRPOConfig(gated_delta_rule="recurrent")`: Qwen3.5's Gated DeltaNet in training forwards with the
rollout's recurrent values and the chunked form's gradient (trace_hf/train/delta_rule.py)."""

from __future__ import annotations

import pytest
import torch

from trace_hf import TraceFP4Config, TraceGRPOConfig
from trace_hf import testing as T
from trace_hf.train.delta_rule import delta_rule_modules, recurrent_values, torch_rule, torch_rules


def _rules():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as M

    return M, *torch_rules(M)


def _inputs(seq=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, hk, hv, dk, dv = 2, 2, 4, 16, 8
    q, k = (torch.randn(b, seq, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(b, seq, hv, dv, generator=g)
    gate = -torch.rand(b, seq, hv, generator=g)
    beta = torch.rand(b, seq, hv, generator=g)
    return [t.requires_grad_() for t in (q, k, v, gate, beta)]


def _grads(out, inputs):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    return torch.autograd.grad((out * w).sum(), inputs)


def test_values_are_recurrent_and_gradient_is_chunked():
    M, chunk, recurrent = _rules()
    model = T.tiny_model("qwen3_5_moe_text", num_hidden_layers=2)
    x = _inputs()
    kw = {"initial_state": None, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    ref_c, _ = chunk(*x, **kw)
    ref_r, state_r = recurrent(*x, **kw)
    assert not torch.equal(ref_c, ref_r)  # 80 tokens: the chunked sums round otherwise
    original = M.torch_chunk_gated_delta_rule
    with recurrent_values(model):
        out, state = M.torch_chunk_gated_delta_rule(*x, **kw)
        with torch.no_grad():
            out_ng, _ = M.torch_chunk_gated_delta_rule(*x, **kw)
    assert torch.equal(out, ref_r) and torch.equal(state, state_r) and torch.equal(out_ng, ref_r)
    for a, b in zip(_grads(out, x), _grads(ref_c, x), strict=True):
        assert torch.equal(a, b)
    assert M.torch_chunk_gated_delta_rule is original  # the context restored transformers' function


def test_model_forward_takes_the_recurrent_values_and_nests():
    M, _, recurrent = _rules()
    model = T.tiny_model("qwen3_5_moe_text", num_hidden_layers=2).train()
    assert [m.__name__ for m in delta_rule_modules(model)] == [M.__name__]
    ids = torch.randint(0, model.config.vocab_size, (2, 70), generator=torch.Generator().manual_seed(0))
    base = model(ids).logits
    with recurrent_values(model), recurrent_values(model):
        rec = model(ids).logits
        rec.sum().backward()  # the chunked backward runs under the rebound function
    saved = M.torch_chunk_gated_delta_rule

    def recurrent_only(q, k, v, g, beta, chunk_size=64, **kw):
        kw.pop("cu_seqlens", None)
        return recurrent(q, k, v, g, beta, **kw)

    M.torch_chunk_gated_delta_rule = recurrent_only
    try:
        want = model(ids).logits
    finally:
        M.torch_chunk_gated_delta_rule = saved
    assert torch.equal(rec, want) and not torch.equal(rec, base)
    assert all(p.grad is not None for n, p in model.named_parameters() if "linear_attn" in n)


def test_recurrent_is_refused_where_it_cannot_apply(tmp_path):
    with pytest.raises(ValueError, match="gated_delta_rule"):
        TraceGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, gated_delta_rule="fused")
    with pytest.raises(ValueError, match="Gated DeltaNet layers"), recurrent_values(T.tiny_model("qwen3_moe")):
        pass
    M, _, _ = _rules()
    model = T.tiny_model("qwen3_5_moe_text", num_hidden_layers=2)
    x = [t.detach() for t in _inputs(seq=8)]
    with pytest.raises(ValueError, match="cu_seqlens"), recurrent_values(model):
        M.torch_chunk_gated_delta_rule(*x, cu_seqlens=torch.tensor([0, 4, 8]))


def test_trainer_trains_qwen35_with_recurrent_values(tmp_path, engine_grpo_step, engine_grpo_metrics):
    from transformers import AutoModelForCausalLM

    M, chunk, recurrent = _rules()
    path = T.save_tiny_model(tmp_path / "tiny", "qwen3_5_moe_text", num_hidden_layers=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 quantization_config=TraceFP4Config(hint_layers=2))  # fmt: skip
    calls = []

    def counted(*args, **kwargs):  # the engine steps its own delta rule: calls here are the training forwards'
        calls.append(args[0].shape[1])
        return recurrent(*args, **kwargs)

    saved, M.torch_recurrent_gated_delta_rule = M.torch_recurrent_gated_delta_rule, counted
    try:
        trainer, logged, changed = engine_grpo_step(model, gated_delta_rule="recurrent")
    finally:
        M.torch_recurrent_gated_delta_rule = saved
    assert calls and all(n > 1 for n in calls)  # whole sequences, old log-probs and training forward
    for key in engine_grpo_metrics:
        assert key in logged, key
    assert any("linear_attn" in n for n in changed)
    assert torch_rule(M.torch_chunk_gated_delta_rule) is chunk  # nothing left rebound after training


def test_trainer_refuses_recurrent_without_gated_deltanet(tmp_path, engine_grpo_step):
    model = T.tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="qwen3_moe model has none"):
        engine_grpo_step(model, gated_delta_rule="recurrent", rollout_precision="bf16", trace_hints=False,
                         routing_replay=False)  # fmt: skip


def test_auto_is_recurrent_where_there_are_gated_deltanet_layers():
    from trace_hf.train.delta_rule import resolve_gated_delta_rule

    qwen35, qwen3 = T.tiny_model("qwen3_5_moe_text", num_hidden_layers=2), T.tiny_model("qwen3_moe")
    assert resolve_gated_delta_rule(qwen35, "auto") == "recurrent"
    assert resolve_gated_delta_rule(qwen35, "chunk") == "chunk"
    assert resolve_gated_delta_rule(qwen3, "auto") == resolve_gated_delta_rule(qwen3, "chunk") == "chunk"
    with pytest.raises(ValueError, match="Leave TraceGRPOConfig.gated_delta_rule='auto'"):
        resolve_gated_delta_rule(qwen3, "recurrent")


@pytest.mark.parametrize("kernel", [False, True])
def test_recurrent_values_keep_every_gradient_of_the_chunked_form(kernel, monkeypatch):
    """Under checkpointing, every parameter's gradient with the recurrent values (torch loop, or the kernel through
    the interpreter) is the chunked form's up to fp32 summation order: the straight-through estimator drops none
    (on the H100 the recurrent mode's backward ran faster than the chunked one's, docs/benchmarks.md)."""
    import contextlib

    from trace_hf.train import delta_rule

    model = T.tiny_model("qwen3_5_moe_text", num_hidden_layers=4, linear_key_head_dim=16, linear_value_head_dim=16)
    model.train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    # two rows of 70 tokens: two of the chunked form's 64-token chunks, the second partial
    ids = torch.randint(0, model.config.vocab_size, (2, 70), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(delta_rule, "_use_kernel", lambda q: kernel)

    def grads(ctx):
        model.zero_grad(set_to_none=True)
        with ctx:
            model(ids).logits.float().logsumexp(-1).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    chunk, recurrent = grads(contextlib.nullcontext()), grads(delta_rule.recurrent_values(model))
    assert chunk.keys() == recurrent.keys() and any("linear_attn" in n for n in chunk)
    # Relative to each gradient, with a floor at 1e-8 of the whole gradient: some (a layer's dt_bias, A_log) are ~1e-9
    # of it here, where fp32 order alone moves them by ~1% and by how much depends on the CPU's thread count.
    scale = torch.cat([g.flatten() for g in chunk.values()]).norm()
    for n, g in chunk.items():
        assert (recurrent[n] - g).norm() <= 1e-4 * g.norm() + 1e-8 * scale, n
