# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The rollout engine on Qwen3.5 MoE (Gated DeltaNet + gated full attention + shared expert) against `generate`,
its freshness, and the trainer rolling out through it. CPU: eager through the Triton interpreter, fp32."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from rollout_inputs import greedy_config, random_prompts

from trace_hf import TraceFP4Config
from trace_hf import testing as T
from trace_hf.quant.experts import fp4_experts
from trace_hf.quant.quantizer import quantize_model
from trace_hf.rollout import EngineRollout, GenerateRollout, make_rollout, unsupported_reason
from trace_hf.rollout.engine.layouts import QWEN3_5_MOE, QWEN3_MOE, layout_of
from trace_hf.rollout.engine.qwen35 import HybridDecoder


pytest.importorskip("trace_hf.kernels.sampling")


pytestmark = pytest.mark.usefixtures("one_thread")


SITES = ("experts_input", "experts_hidden", "kv")


def _model(fp4: bool, device="cpu", sites=SITES, **overrides):
    """Two layers: linear attention (Gated DeltaNet), then gated full attention; both MoE with a shared expert."""
    model = T.tiny_model("qwen3_5_moe_text", num_hidden_layers=2, **overrides)
    assert model.config.layer_types == ["linear_attention", "full_attention"]
    if fp4:
        quantize_model(model, TraceFP4Config(hint_layers=2, hint_sites=list(sites)))
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    return model.to(device=device, dtype=dtype).eval()


def _prompts(model, lengths=(6, 2, 9), seed=1):
    """Left padding of different widths; the 2-token prompt is shorter than the conv kernel (4)."""
    return random_prompts(model, lengths, seed)


def _gc(**kw):
    return greedy_config(**{"max_new_tokens": 5, **kw})


def test_layouts_name_each_family_once():
    assert layout_of(T.tiny_qwen3_5_moe_config()) is QWEN3_5_MOE and QWEN3_5_MOE.hybrid
    assert layout_of(T.tiny_qwen3_moe_config()) is QWEN3_MOE and not QWEN3_MOE.hybrid
    assert "qwen3_5_moe" in QWEN3_5_MOE.model_types and QWEN3_5_MOE.decoder is HybridDecoder


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_add_rmsnorm_follows_qwen35_rmsnorm(dtype):
    """`add_rmsnorm(..., round_normalized=False)` with the fp32 ``1 + w`` computes transformers' Qwen3.5 RMSNorm of
    the residual (up to the kernel's fp32 rsqrt and sum order; in bf16 more often equal than Qwen3's rounding of the
    normalized value would be), and `add_rmsnorm_fp4` quantizes exactly what it returns. bf16 on the GPU only: the
    interpreter's fp32 -> bf16 casts do not round as the GPU's (and torch's) do."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

    from trace_hf import fp4
    from trace_hf.kernels import decode_ops

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    res, add = torch.randn(64, 64, generator=g).to(dev, dtype), torch.randn(64, 2, 64, generator=g).to(dev)
    norm = Qwen3_5MoeRMSNorm(64).to(dev, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g).to(dev) * 0.3)
        summed = (res.float() + add[:, 0] + add[:, 1]).to(dtype)
        want = norm(summed)
        w = norm.weight.float() + 1.0
        r1, r2 = res.clone(), res.clone()
        out = decode_ops.add_rmsnorm(r1, add, w, norm.eps, round_normalized=False)
        out4, q = decode_ops.add_rmsnorm_fp4(r2, add, w, norm.eps, round_normalized=False)
        qwen3_way = decode_ops.add_rmsnorm(summed.clone(), None, w, norm.eps)
    torch.testing.assert_close(r1, summed, rtol=1e-6, atol=1e-6)
    tol = {"rtol": 2**-7, "atol": 1e-5} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(out, want, **tol)
    assert torch.equal(out4, out) and torch.equal(q.packed, fp4.quantize(out, "nvfp4", "row").packed)
    if dtype == torch.bfloat16:
        assert (out == want).float().mean() > (qwen3_way == want).float().mean()


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_shared_expert_kernels_follow_transformers(dtype):
    """`silu_mul` and `add_rmsnorm(..., gated=...)` against transformers' Qwen3.5 shared expert (its MLP and
    ``sigmoid(shared_expert_gate(x)) * mlp(x)``) added to routed slots and the residual: the residual sum equal up to
    fp32 summation order (in bf16, bits equal on > 99%)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeMLP

    from trace_hf.kernels import decode_ops

    dev = "cuda" if dtype == torch.bfloat16 else "cpu"
    model = T.tiny_model("qwen3_5_moe_text", num_hidden_layers=2)
    c = model.config
    moe = model.model.layers[0].mlp
    assert isinstance(moe.shared_expert, Qwen3_5MoeMLP)
    moe = moe.to(dev, dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, c.hidden_size, generator=g).to(dev, dtype)
    res, routed = (
        torch.randn(16, c.hidden_size, generator=g).to(dev, dtype),
        torch.randn(16, 8, c.hidden_size, generator=g).to(dev),
    )
    se = moe.shared_expert
    w_shared = torch.cat([se.gate_proj.weight, se.up_proj.weight, moe.shared_expert_gate.weight])
    with torch.no_grad():
        want_shared = torch.sigmoid(moe.shared_expert_gate(x)) * se(x)
        want = (res.float() + routed.sum(1) + want_shared.float()).to(dtype)
        proj = x @ w_shared.T
        S = se.gate_proj.out_features
        h = decode_ops.silu_mul(proj, S)
        want_h = F.silu(proj[:, :S]) * proj[:, S : 2 * S]
        torch.testing.assert_close(h, want_h, rtol=1e-6 if dtype == torch.float32 else 2**-7, atol=1e-6)
        assert dtype == torch.float32 or (h == want_h).float().mean() > 0.99
        y = h @ se.down_proj.weight.T
        decode_ops.add_rmsnorm(res, routed, torch.ones(c.hidden_size, device=dev), 1e-6, gated=(y, proj[:, -1]))
    torch.testing.assert_close(res, want, rtol=1e-5 if dtype == torch.float32 else 2**-7, atol=1e-5)
    if dtype == torch.bfloat16:
        assert (res == want).float().mean() > 0.99
    with pytest.raises(ValueError, match="gated must be"):
        decode_ops.add_rmsnorm(res, None, torch.ones(c.hidden_size, device=dev), 1e-6, gated=(y, proj[:, -1]))


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dv,block_v", [(16, 16), (32, 8)])
def test_gated_deltanet_kernels_step_as_torch(dv, block_v, dev, monkeypatch):
    """The Triton Gated DeltaNet step (`causal_conv_step` + `gated_delta_step`) against the torch step (transformers'
    ops) on one layer from random conv and recurrent states, with gates past softplus' threshold (a + dt_bias > 20),
    near zero and negative, and Dv unequal to Dk: output, conv state and recurrent state equal up to fp32 summation
    order, over 3 tokens; with the norm in the rule's program and in its own launch (``block_v`` < Dv). fp32 on CPU
    (interpreter), bf16 on CUDA."""
    from trace_hf.kernels import gated_delta
    from trace_hf.rollout.engine import weights_from_hf

    monkeypatch.setitem(gated_delta.CONFIG, "block_v", block_v)
    model = _model(False, device=dev, linear_value_head_dim=dv)
    w = weights_from_hf(model)
    lw = w.layers[0]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        lw.a_log.copy_(torch.randn(lw.a_log.shape, generator=g).to(dev))
        lw.dt_bias.copy_(torch.tensor([25.0, 0.0, -30.0, 1.0], device=dev))
        lw.gate_norm.copy_(1 + torch.randn(lw.gate_norm.shape, generator=g).to(dev))
    decs = [HybridDecoder(w, 3, 8, kv_fp4=False, record_hints=False, delta_rule=r) for r in ("torch", "triton")]
    conv, rec = (
        torch.randn(decs[0].conv_states[0].shape, generator=g),
        torch.randn(decs[0].recurrent_states[0].shape, generator=g),
    )
    for dec in decs:
        dec.conv_states[0].copy_(conv.to(dev))
        dec.recurrent_states[0].copy_(rec.to(dev))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dev == "cpu" else {"rtol": 2e-2, "atol": 2e-2}
    for _ in range(3):
        xn = torch.randn(3, model.config.hidden_size, generator=g).to(dev, w.embed.dtype)
        want, got = (dec._linear_attention(xn, lw, 0) for dec in decs)
        torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(decs[1].conv_states[0], decs[0].conv_states[0], rtol=0, atol=0)
    torch.testing.assert_close(decs[1].recurrent_states[0], decs[0].recurrent_states[0], **tol)


def test_gated_deltanet_kernels_refuse_bad_shapes():
    """A state that is not fp32, or a projection of the wrong width, is a ValueError that says what is expected."""
    from trace_hf.kernels.gated_delta import causal_conv_step, gated_delta_step

    B, hk, dk, hv, dv = 2, 2, 16, 4, 16
    C = 2 * hk * dk + hv * dv
    proj = torch.zeros(B, C + hv * dv + 2 * hv)
    with pytest.raises(ValueError, match="conv_state must be contiguous"):
        causal_conv_step(proj, torch.zeros(B, C + 1, 4), torch.zeros(C + 1, 4), (hk, dk, hv, dv))
    qkv = causal_conv_step(proj, torch.zeros(B, C, 4), torch.zeros(C, 4), (hk, dk, hv, dv))
    ones = torch.ones(hv)
    with pytest.raises(ValueError, match="state must be contiguous fp32"):
        gated_delta_step(
            torch.zeros(B, hv, dk, dv, dtype=torch.float64), qkv, proj, ones, ones, torch.ones(dv), 1e-6, hk
        )
    with pytest.raises(ValueError, match=r"proj \[B, "):
        gated_delta_step(torch.zeros(B, hv, dk, dv), qkv, proj[:, :-1], ones, ones, torch.ones(dv), 1e-6, hk)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="a CPU-model check through the interpreter; on CUDA the step kernel is checked by the test above",
)
def test_triton_delta_rule_decodes_as_torch():
    """The decoder with ``delta_rule="triton"`` steps the same logits as with the torch rule."""
    from trace_hf.rollout.engine import weights_from_hf

    model = _model(False)
    w = weights_from_hf(model)
    logits = []
    for rule in ("torch", "triton"):
        dec = HybridDecoder(w, 2, 8, kv_fp4=False, record_hints=False, delta_rule=rule)
        dec.tokens.copy_(torch.tensor([5, 9]))
        for st in dec.recurrent_states[:1]:
            st.copy_(torch.randn(st.shape, generator=torch.Generator().manual_seed(0)))
        for _ in range(3):
            dec.step()
        logits.append(dec.logits.clone())
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fp4", [True, False])
def test_engine_greedy_matches_generate(fp4):
    """Left-padded prompts: same greedy tokens; log-probs within 1e-4 (fp32, summation order only); hints at every
    site (experts input, experts hidden, FP4 K/V of the full-attention layer) and routing equal on > 99.9%."""
    model = _model(fp4)
    assert unsupported_reason(model, require_cuda=False) is None
    assert isinstance(make_rollout(model, "engine"), EngineRollout)
    prompts = _prompts(model)
    a = GenerateRollout()(model, prompts, _gc(), record=fp4)
    b = EngineRollout()(model, prompts, _gc(), record=fp4)
    assert a.completion_ids == b.completion_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-4, rtol=0)
    if not fp4:  # left padding leaves no trace in the linear-attention states: a padded row rolls out as alone
        alone = EngineRollout()(model, prompts[1:2], _gc())
        assert alone.completion_ids[0] == b.completion_ids[1]
        torch.testing.assert_close(torch.tensor(alone.logprobs[0]), torch.tensor(b.logprobs[1]), atol=1e-4, rtol=0)
        return
    ha, hb = a.hints, b.hints
    assert torch.equal(ha.lengths, hb.lengths) and ha.hint_layers == hb.hint_layers and hb.sites == SITES
    assert {k: v.shape for k, v in ha.to_inputs().items()} == {k: v.shape for k, v in hb.to_inputs().items()}
    assert (ha.mantissa_bits == hb.mantissa_bits).float().mean() > 0.999
    assert (ha.block_scale == hb.block_scale).float().mean() > 0.999
    assert (ha.routing == hb.routing).float().mean() > 0.999
    torch.testing.assert_close(ha.global_scale, hb.global_scale, rtol=1e-5, atol=0)
    for site in SITES[1:]:
        (bits_a, scale_a, g_a), (bits_b, scale_b, g_b) = ha.site_hints[site], hb.site_hints[site]
        assert bits_b.any() and (g_b > 0).any()
        assert (bits_a == bits_b).float().mean() > 0.999, site
        assert (scale_a == scale_b).float().mean() > 0.999, site
        torch.testing.assert_close(g_a, g_b, rtol=1e-5, atol=0)


def test_engine_seeded_sampling_and_per_row_stop():
    """Seeded draws repeat; a row that emits an EOS stops there while the others (their own conv and recurrent
    states) roll on unchanged."""
    model = _model(False)
    prompts = _prompts(model)
    gc = {"do_sample": True, "temperature": 1.3, "top_k": 50, "max_new_tokens": 6}
    eng = EngineRollout()
    torch.manual_seed(5)
    a = eng(model, prompts, _gc(**gc, eos_token_id=None))
    torch.manual_seed(5)
    assert eng(model, prompts, _gc(**gc, eos_token_id=None)).completion_ids == a.completion_ids
    eos = a.completion_ids[0][1]
    torch.manual_seed(5)
    d = eng(model, prompts, _gc(**gc, eos_token_id=[eos]))
    assert d.completion_ids[0] == a.completion_ids[0][:2]
    others = [r for r in (1, 2) if eos not in a.completion_ids[r]]
    assert others and all(d.completion_ids[r] == a.completion_ids[r] for r in others)


def test_engine_sees_updates_of_every_qwen35_weight():
    """`.data` edits of weights the engine fuses or offsets (linear-attention projections, decay, conv, shared
    expert and its gate, a zero-centred norm, the gated q_proj) and of the experts' masters reach its next rollout,
    with no new decoder (the graphs stay valid)."""
    model = _model(True, sites=("experts_input",))
    prompts = _prompts(model)
    eng = EngineRollout()
    a = eng(model, prompts, _gc(max_new_tokens=3))
    dec = next(iter(eng._runners.values())).dec
    lin, full = model.model.layers[0], model.model.layers[1]
    with torch.no_grad():
        for p in (lin.linear_attn.in_proj_qkv.weight, lin.linear_attn.conv1d.weight, lin.mlp.shared_expert.up_proj.weight,
                  full.self_attn.q_proj.weight, lin.mlp.shared_expert_gate.weight):  # fmt: skip
            p.data.mul_(-3.0)
        lin.linear_attn.A_log.data.sub_(2.0)
        full.post_attention_layernorm.weight.data.add_(1.5)
        for m in fp4_experts(model):
            m.down_proj.data.mul_(-2.0)
    b = eng(model, prompts, _gc(max_new_tokens=3))
    assert next(iter(eng._runners.values())).dec is dec
    c = GenerateRollout()(model, prompts, _gc(max_new_tokens=3))
    assert b.completion_ids == c.completion_ids and b.completion_ids != a.completion_ids
    for x, y in zip(b.logprobs, c.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-4, rtol=0)


def test_trainer_rolls_out_qwen35_through_the_engine(tmp_path, engine_grpo_step, engine_grpo_metrics):
    from transformers import AutoModelForCausalLM

    path = T.save_tiny_model(tmp_path / "tiny", "qwen3_5_moe_text", num_hidden_layers=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 quantization_config=TraceFP4Config(hint_layers=2))  # fmt: skip
    trainer, logged, changed = engine_grpo_step(model)
    assert isinstance(trainer.rollout, EngineRollout)
    for key in engine_grpo_metrics:
        assert key in logged, key
    for part in ("experts", "linear_attn", "self_attn", "shared_expert"):
        assert any(part in n for n in changed), part


@pytest.mark.gpu
def test_qwen35_engine_graphs_match_eager_gpu():
    """On the GPU (bf16, CUDA graphs): the captured step replays what the eager step computes, hints included, and
    the greedy engine's first token equals generate's (later bf16 tokens may part on near-ties)."""
    model = _model(True, "cuda")
    prompts = _prompts(model, (9, 3, 17, 5, 12))
    gc = _gc(do_sample=True, temperature=0.9, top_p=0.9, max_new_tokens=24)
    torch.manual_seed(3)
    a = EngineRollout(use_graphs=True)(model, prompts, gc, record=True)
    torch.manual_seed(3)
    b = EngineRollout(use_graphs=False)(model, prompts, gc, record=True)
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs
    assert torch.equal(a.hints.mantissa_bits, b.hints.mantissa_bits)
    for site in SITES[1:]:
        for x, y in zip(a.hints.site_hints[site], b.hints.site_hints[site], strict=True):
            assert torch.equal(x, y), site
    g = GenerateRollout()(model, prompts, _gc(max_new_tokens=8))
    e = EngineRollout()(model, prompts, _gc(max_new_tokens=8))
    assert [r[0] for r in g.completion_ids] == [r[0] for r in e.completion_ids]
    agree = sum(x == y for r, s in zip(g.completion_ids, e.completion_ids, strict=True) for x, y in zip(r, s))
    print(f"bf16 greedy tokens equal to generate's: {agree}/{sum(map(len, g.completion_ids))}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU mode")
def test_decode_benchmark_smoke(tmp_path):
    """`benchmarks.rollout.decode_qwen35 --smoke` steps every setup (BF16 and FP4, each with either delta rule) and
    names each setup's best batch; ``--admit`` adds the cell the engine admits, FP4's with its step records held."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))
    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.rollout.decode_qwen35", "--smoke", "--out", str(out),
                           "--setups", "fp4_triton,bf16,fp4,bf16_triton", "--admit"],
                          cwd=str(tmp_path), env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    cells = res["cells"]
    order = [(c["setup"], c.get("admitted", False)) for c in cells]
    assert order == [(x, a) for x in ("bf16", "bf16_triton", "fp4", "fp4_triton") for a in (False, True)], order
    assert all("step_ms" in c for c in cells), cells  # BF16 before quantizing; every cell ran
    records = {c["setup"]: c["records_gib"] for c in cells if c.get("admitted")}
    assert records["bf16"] == records["bf16_triton"] == 0 < records["fp4"] == records["fp4_triton"], records
    best = res["best"]["16"]
    assert (
        best["fp4_triton_over_bf16_triton"] == best["fp4_triton"]["tokens_per_s"] / best["bf16_triton"]["tokens_per_s"]
    )
    assert best["fp4_triton_admitted"]["batch"] == 1  # no memory budget on the CPU: one row a wave
