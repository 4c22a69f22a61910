# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Hints at every FP4 site: experts_input, experts_hidden, kv. Tiny models on CPU in fp32."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

from trace_hf import HintBatch, HintRecorder, TraceFP4Config, TraceGRPOConfig, TraceGRPOTrainer, fp4, use_hints
from trace_hf import data as D
from trace_hf import testing as T
from trace_hf.hints import hint_bytes_per_token, hint_bytes_per_token_by_site, position_ids_from_mask
from trace_hf.hints.replay import Guide
from trace_hf.rollout import EngineRollout, make_rollout, unsupported_reason


SITES = ("experts_input", "experts_hidden", "kv")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return T.save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3_moe")


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return T.save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3_5", family="qwen3_5_moe_text")


def load(path, sites=SITES, hint_layers=4, **quant):
    cfg = TraceFP4Config(hint_layers=hint_layers, hint_sites=list(sites), kv_cache="nvfp4", **quant)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=cfg)


def perturb_rollout(model, sites=SITES, scale=1e-2, seed=0):
    """Stand in for the rollout kernels' own rounding (as `perturb_rollout` in tests/train/test_trainer.py does for the MoE
    input): small noise in eval mode only, right where each site's values are computed, and nowhere else (the router
    input stays clean): the experts' input, the expert activation feeding the down projection, and K and V."""
    gen = torch.Generator().manual_seed(seed)

    def noisy(t):
        return t * (1 + scale * torch.randn(t.shape, generator=gen).to(t.dtype))

    def on_output(module, args, output):
        return output if module.training else noisy(output)

    def on_input(module, args):
        return args if module.training else (noisy(args[0]), *args[1:])

    for layer in model.model.layers:
        experts = layer.mlp.experts
        if "experts_input" in sites:
            experts.register_forward_pre_hook(on_input)
        if "experts_hidden" in sites:
            experts.act_fn.register_forward_hook(on_output)
        if "kv" in sites:
            layer.self_attn.k_norm.register_forward_hook(on_output)
            layer.self_attn.v_proj.register_forward_hook(on_output)
    return model


class CodeRecorder(HintRecorder):
    """A HintRecorder that also keeps the rollout's full codes at every hinted site (for checking)."""

    def __enter__(self):
        self.codes = {}
        return super().__enter__()

    def record_input(self, site, q, hints=None):
        super().record_input(site, q, hints)
        self.codes.setdefault(("experts_input", site.moe_layer), []).append(self._shape(q.codes()))

    def record_hidden(self, site, q, inverse, top_k, hints=None):
        super().record_hidden(site, q, inverse, top_k, hints)
        codes = q.codes()[inverse].unflatten(0, (-1, top_k))
        self.codes.setdefault(("experts_hidden", site.moe_layer), []).append(self._shape(codes))

    def _record_site(self, site, layer, rows):
        super()._record_site(site, layer, rows)
        self.codes.setdefault((site, layer), []).append(self._shape(rows.codes()))


def rollout(model, n=5, new_tokens=8, recorder=CodeRecorder, seed=0):
    tok = T.build_char_tokenizer()
    texts = [D.format_prompt(f"{i * 7 % 10}+{i}" + " and more" * (i % 3)) for i in range(n)]
    enc = tok(texts, return_tensors="pt", padding=True)
    model.eval()
    torch.manual_seed(seed)
    with recorder(model) as rec:
        seq = model.generate(**enc, max_new_tokens=new_tokens, do_sample=True)
    mask = torch.cat([enc.attention_mask, torch.ones_like(seq[:, enc.input_ids.shape[1] :])], dim=1)
    return rec, seq, mask


def spy(monkeypatch):
    """Captures (site, layer, training input, hints, has) of every guided quantization in the training forward."""
    seen = []
    quantize = Guide.quantize

    def on_site(self, x, hints, has, rows):
        seen.append((self.site, self.layer, x.detach(), hints, has))
        assert rows == int(has.sum()), "the hinted rows counted must be the has rows"
        return quantize(self, x, hints, has, rows)

    monkeypatch.setattr(Guide, "quantize", on_site)
    return seen


def agreement(rec, seen, site, rows, mask, full_mask, applied):
    """Fraction of hinted elements at `site` where the code training used equals the rollout's code, matched by
    (sample, position) through the attention masks (rows are permuted against the rollout)."""
    real = torch.sort((~full_mask.bool()).to(torch.int8), dim=1, stable=True).indices  # p-th real column per sample
    pos = position_ids_from_mask(mask)
    equal = total = 0
    for s, layer, x, hints, has in seen:
        if s != site:
            continue
        used = fp4.guided_quantize(x, hints) if applied else fp4.quantize(x, hints.fmt, "row")
        codes = used.codes()
        roll = torch.cat(rec.codes[(site, layer)], dim=1)  # [B, fed columns, ...]
        col = torch.gather(real[rows], 1, pos).clamp(max=roll.shape[1] - 1)
        want = roll[rows[:, None], col].flatten(0, 1)  # [B * S, ...] like the training rows
        m = has.unsqueeze(-1).expand_as(codes)
        same = (codes == want) | (((codes | want) & 7) == 0)  # +0 and -0 are the same value
        equal += int((same & m).sum())
        total += int(m.sum())
    return equal / total, total


# ----------------------------------------------------------------------------------------------------------
# Recording and replay at each site
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("site", SITES)
def test_hints_at_a_site_reproduce_the_rollout_codes(model_dir, monkeypatch, site):
    model = perturb_rollout(load(model_dir, [site]), [site])
    rec, seq, mask = rollout(model)
    hints = rec.collect(mask)
    assert hints.sites == (site,)
    rows = torch.tensor([3, 0, 4, 2, 1])
    model.train()
    result = {}
    for applied in (True, False):
        seen = spy(monkeypatch)
        with torch.no_grad(), use_hints(model, hints[rows], mask[rows], apply_hints=applied) as report:
            model(input_ids=seq[rows], attention_mask=mask[rows])
        monkeypatch.undo()
        rate, total = agreement(rec, seen, site, rows, mask[rows], mask, applied)
        result[applied] = rate
        assert set(report.flip_rate_by_site()) == {site}
        assert sorted(report.flip_rate_by_layer(site)) == [0, 1, 2, 3]
        assert report.hint_flip_rate == report.flip_rate_by_site()[site]
        assert total > 1000
    print(f"{site}: training codes == rollout codes with hints {result[True]:.5f}, without {result[False]:.5f}")
    assert result[True] >= 0.999
    assert result[False] < result[True] and result[False] < 0.999  # the perturbation left flips to correct


def test_all_sites_together_and_sites_must_match(model_dir):
    model = perturb_rollout(load(model_dir))
    rec, seq, mask = rollout(model, recorder=HintRecorder)
    hints = rec.collect(mask)
    assert hints.sites == SITES
    model.train()
    rates = {}
    for applied in (True, False):
        with torch.no_grad(), use_hints(model, hints, mask, apply_hints=applied) as report:
            model(input_ids=seq, attention_mask=mask)
        rates[applied] = report.flip_rate_by_site()
        by_site = report.counts_by_site()
        assert report.hint_flip_rate == pytest.approx(
            sum(f for f, _ in by_site.values()) / sum(e for _, e in by_site.values())
        )
    # With every site guided, training recomputes the rollout's activations: nearest rounding flips less than
    # without hints, where each site's flips propagate to the next.
    for site in SITES:
        assert rates[True][site] < rates[False][site], (site, rates)
    # Hints of other sites than the model's are refused.
    only_input = load(model_dir, ["experts_input"])
    only_input.train()
    with pytest.raises(ValueError, match="hint_sites"), use_hints(only_input, hints, mask):
        pass


def test_fused_experts_record_hidden_hints_as_the_torch_path(model_dir):
    """experts_hidden recorded through the fused Triton experts (the quantized hidden they already compute, put back
    in slot order) equals the torch path's recording: same shapes, the same values up to the kernels' summation
    order (a code may flip where a value sits on a rounding boundary)."""
    tok = T.build_char_tokenizer()
    enc = tok([D.format_prompt("3+4 and more"), D.format_prompt("12+7")], return_tensors="pt", padding=True)
    hints = {}
    for kernel in ("torch", "triton"):
        model = load(model_dir, ["experts_hidden"], hint_layers=2, experts_kernel=kernel).eval()
        with HintRecorder(model) as rec:
            seq = model.generate(**enc, max_new_tokens=3, do_sample=False)
        completion = torch.ones_like(seq[:, enc.input_ids.shape[1] :])
        hints[kernel] = rec.collect(torch.cat([enc.attention_mask, completion], dim=1))
    a, b = hints["torch"], hints["triton"]
    assert b.sites == ("experts_hidden",) and torch.equal(a.routing, b.routing) and torch.equal(a.lengths, b.lengths)
    (bits_a, scale_a, g_a), (bits_b, scale_b, g_b) = a.site_hints["experts_hidden"], b.site_hints["experts_hidden"]
    cfg = model.config
    want = (2, int(a.lengths.max()), 2, cfg.num_experts_per_tok, cfg.moe_intermediate_size // 8)  # [B, L, n, k, I/8]
    assert bits_a.shape == bits_b.shape == want
    assert scale_a.shape == scale_b.shape and g_a.shape == g_b.shape == bits_a.shape[:-1]
    assert bits_a.any() and (g_a > 0).any()
    same_bits = (fp4.unpack_bits(bits_a) == fp4.unpack_bits(bits_b)).float().mean()
    print(f"fused vs torch experts_hidden hints: mantissa bits {same_bits:.5f}")
    assert same_bits > 0.999
    assert (scale_a == scale_b).float().mean() > 0.999
    torch.testing.assert_close(g_a, g_b, rtol=1e-5, atol=0)


def test_fused_experts_record_the_hidden_hints_their_quantization_wrote(model_dir, monkeypatch):
    """The fused experts hand the recorder the hidden's hints as their quantization wrote them
    (`QuantizedHidden.hints`): the recording has the bits of one extracted from the codes (`fp4.extract_hints`)."""
    tok = T.build_char_tokenizer()
    enc = tok([D.format_prompt("3+4 and more"), D.format_prompt("12+7")], return_tensors="pt", padding=True)
    model = load(model_dir, ["experts_hidden"], hint_layers=2, experts_kernel="triton").eval()
    record, passed = HintRecorder.record_hidden, []

    def spy(self, site, q, inverse, top_k, hints=None):
        passed.append(hints is not None)
        record(self, site, q, inverse, top_k, hints)
        # The same rows from the codes, as before `hints` was passed: they must give the same records.
        record(self, site, q, inverse, top_k)
        a, b = self._site_records["experts_hidden"][site.moe_layer][-2:]
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        self._site_records["experts_hidden"][site.moe_layer].pop()

    monkeypatch.setattr(HintRecorder, "record_hidden", spy)
    with HintRecorder(model):
        model.generate(**enc, max_new_tokens=2, do_sample=False)
    assert passed and all(passed)


@pytest.mark.parametrize(
    ("align", "device"), [("torch", "cpu"), ("triton", "cpu"), pytest.param("auto", "cuda", marks=pytest.mark.gpu)]
)
def test_fused_hidden_rows_come_back_in_slot_order(align, device):
    """`QuantizedHidden.positions` finds every (token, slot)'s row in the fused experts' sorted, padded layout, with
    either alignment backend (on the GPU: whichever kernels it picks, shapes the Hopper ones take): slot order holds
    each token's hidden for the expert routed in that slot."""
    from trace_hf.kernels import fp4_moe

    g = torch.Generator(device).manual_seed(0)
    E, M, k = 8, 6, 2
    H, width = (64, 32) if device == "cpu" else (256, 128)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)

    w_gu = fp4.quantize(randn(E, 2 * width, H), "nvfp4", "expert")
    w_d = fp4.quantize(randn(E, H, width), "nvfp4", "expert")
    xq = fp4.quantize(randn(M, H), "nvfp4", "row")
    ids = torch.stack([torch.randperm(E, generator=g, device=device)[:k] for _ in range(M)])
    tw = torch.rand(M, k, generator=g, device=device)
    _, hidden = fp4_moe.experts_from_quantized(xq, ids, tw, w_gu, w_d, align_backend=align, return_hidden=True)
    pos = hidden.positions()
    assert pos.shape == (M * k,) and len(set(pos.tolist())) == M * k
    assert torch.equal(hidden.slots[pos].long(), torch.arange(M * k, device=device))
    gate, up = torch.einsum("mh,mknh->mkn", xq.dequantize(), w_gu.dequantize()[ids]).chunk(2, dim=-1)
    want = fp4.quantize((torch.nn.functional.silu(gate) * up).flatten(0, 1), "nvfp4", "row")
    assert (hidden.q.codes()[pos] == want.codes()).float().mean() > 0.99
    assert torch.equal(hidden.hints.mantissa_bits[pos], fp4.extract_hints(hidden.q).mantissa_bits[pos])


# ----------------------------------------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------------------------------------


def row_bytes(width):
    return width // 8 + width // 16 + 4


def recorded_bytes_per_token(hints: HintBatch, site: str) -> float:
    ts = (hints.mantissa_bits, hints.block_scale, hints.global_scale) if site == "experts_input" else None
    ts = ts or hints.site_hints[site]
    b, length = ts[0].shape[:2]
    return sum(t.numel() * t.element_size() for t in ts) / (b * length)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe_text"])
def test_bytes_per_token_from_config_match_the_records(model_dir, hybrid_dir, family):
    path, n = (model_dir, 3) if family == "qwen3_moe" else (hybrid_dir, 2)
    model = load(path, hint_layers=n)
    rec, seq, mask = rollout(model, n=3, new_tokens=4, recorder=HintRecorder)
    hints = rec.collect(mask)
    cfg = model.config
    by_site = hint_bytes_per_token_by_site(cfg, hint_layers=n, sites=SITES)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    n_kv = sum(t == "full_attention" for t in types[-n:])  # every layer of the tiny models is MoE
    assert by_site == {
        "experts_input": n * row_bytes(cfg.hidden_size),
        "experts_hidden": n * cfg.num_experts_per_tok * row_bytes(cfg.moe_intermediate_size),
        "kv": n_kv * 2 * cfg.num_key_value_heads * row_bytes(cfg.head_dim),
    }
    assert hints.bytes_per_token_by_site() == by_site
    for site in SITES:
        assert recorded_bytes_per_token(hints, site) == by_site[site]
    assert hints.bytes_per_token() == hint_bytes_per_token(cfg, hint_layers=n, sites=SITES) == sum(by_site.values())


def test_bytes_per_token_at_qwen35_35b_shape():
    cfg = Qwen3_5MoeTextConfig()  # transformers' defaults are Qwen3.5-35B-A3B's text shape
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        2048, 40, 8, 512,
    )  # fmt: skip
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.layer_types.count("full_attention")) == (2, 256, 10)
    paper = hint_bytes_per_token_by_site(cfg, sites=SITES)
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert paper == {
        "experts_input": 20 * row_bytes(2048),
        "experts_hidden": 20 * 8 * row_bytes(512),
        "kv": sum(i >= 20 for i in full) * 2 * 2 * row_bytes(256),
    }
    assert hint_bytes_per_token(cfg) == paper["experts_input"] == 7760  # the default: the paper's setting
    every = hint_bytes_per_token_by_site(cfg, hint_layers=40, sites=SITES)
    assert every == {k: v * 2 for k, v in paper.items()}  # the last 20 layers hold 5 of the 10 full-attention layers
    print("bytes per token, last 20 layers:", paper, "all 40:", every)


# ----------------------------------------------------------------------------------------------------------
# Config, storage, refusals
# ----------------------------------------------------------------------------------------------------------


def test_hint_sites_validation(model_dir):
    with pytest.raises(ValueError, match=r"list or tuple of sites, e.g. \['kv'\]"):
        TraceFP4Config(hint_sites="kv")
    with pytest.raises(ValueError, match="name each site once"):
        TraceFP4Config(hint_sites=["kv", "kv"])
    with pytest.raises(ValueError, match="at least one"):
        TraceFP4Config(hint_sites=[])
    with pytest.raises(ValueError, match="experts_hidden"):
        TraceFP4Config(hint_sites=["attention"])
    with pytest.raises(ValueError, match="kv_cache='nvfp4'"):
        TraceFP4Config(hint_sites=["kv"], kv_cache=None)
    with pytest.raises(ValueError, match="kv_cache='mxfp4'"):
        TraceFP4Config(hint_sites=["kv"], fmt="mxfp4", kv_cache="nvfp4")
    with pytest.raises(ValueError, match="unknown sites"):
        hint_bytes_per_token(T.tiny_config(), sites="kv")
    cfg = TraceFP4Config(hint_sites=("kv", "experts_input"))
    assert cfg.to_dict()["hint_sites"] == ["kv", "experts_input"]
    assert TraceFP4Config.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    assert cfg.hint_site_tuple == ("experts_input", "kv")
    assert TraceFP4Config().hint_site_tuple == ("experts_input",)


def test_hint_batch_rows_and_inputs_carry_the_sites(model_dir):
    model = load(model_dir)
    rec, seq, mask = rollout(model, n=4, new_tokens=4, recorder=lambda m: HintRecorder(m, storage="cpu"))
    hints = rec.collect(mask)
    perm = torch.tensor([2, 0, 3, 1])
    sub = hints[perm]
    for site in ("experts_hidden", "kv"):
        for a, b in zip(sub.site_hints[site], hints.site_hints[site], strict=True):
            assert torch.equal(a, b[perm])
    assert hints[1].sites == SITES and len(hints[1]) == 1
    assert torch.equal(hints[1].site_hints["kv"][0], hints.site_hints["kv"][0][1:2])
    inputs = sub.to_inputs()
    assert {"trace_experts_hidden_mantissa_bits", "trace_kv_block_scale", "trace_kv_global_scale"} <= set(inputs)
    assert all(t.shape[0] == 4 for t in inputs.values())
    again = HintBatch.from_inputs(inputs, sub.fmt, sub.hint_layers)
    assert again.sites == SITES and again.bytes_per_token() == sub.bytes_per_token()
    for site in ("experts_hidden", "kv"):
        assert all(torch.equal(a, b) for a, b in zip(again.site_hints[site], sub.site_hints[site], strict=True))
    # The default records experts_input only: the same columns as before sites existed.
    default = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=TraceFP4Config(hint_layers=4))
    d_rec, _, d_mask = rollout(default, n=2, new_tokens=2, recorder=HintRecorder)
    d_hints = d_rec.collect(d_mask)
    assert d_hints.sites == ("experts_input",) and not d_hints.site_hints
    assert set(d_hints.to_inputs()) == {*HintBatch.input_keys(), "trace_token_ids"}


def test_rollout_engine_takes_every_site(model_dir):
    """The engine records every site (tests/rollout/test_rollout.py checks its hints): no refusal, so "auto" falls back to
    generate only where the engine cannot run at all (here: no CUDA device)."""
    model = load(model_dir).eval()
    assert unsupported_reason(model, require_cuda=False) is None
    assert isinstance(make_rollout(model, "engine"), EngineRollout)
    assert "CUDA" in unsupported_reason(model)


# ----------------------------------------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------------------------------------


def varied_reward(completions, **kwargs):
    return [float(sum(map(ord, c)) % 7) / 7 for c in completions]


def test_trainer_logs_the_flip_rate_of_every_site(model_dir, tmp_path):
    rows = [(a, b) for a in range(4) for b in range(4)]
    dataset = Dataset.from_dict({"prompt": [D.format_prompt(f"{a}+{b}") for a, b in rows]})
    model = perturb_rollout(load(model_dir))
    args = TraceGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, num_generations=4,
        max_completion_length=6, max_steps=2, learning_rate=1e-3, logging_steps=1, save_strategy="no",
        report_to="none", seed=0, bf16=False, use_cpu=True, dataloader_pin_memory=False, disable_tqdm=True,
    )  # fmt: skip
    trainer = TraceGRPOTrainer(
        model, [varied_reward], args=args, train_dataset=dataset, processing_class=T.build_char_tokenizer()
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "trace/hint_flip_rate" in h]
    assert len(logs) == 2
    for h in logs:
        per_site = [h[f"trace/hint_flip_rate/{site}"] for site in SITES]
        # The overall rate is the element-weighted mean of the sites' rates.
        assert min(per_site) <= h["trace/hint_flip_rate"] <= max(per_site)
        assert h["trace/hint_bytes_per_token"] == hint_bytes_per_token(model.config, hint_layers=4, sites=SITES)
        # The training forward, after TRL's shuffle and split, met its own rows' hints at every site (misaligned
        # trace_* columns would disagree with nearest rounding on a large fraction of elements).
        assert h["trace/train/hint_flip_rate"] < 0.2
