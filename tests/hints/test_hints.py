# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Record at rollout (cached decode), replay in one full-sequence training forward (CPU, tiny models in BF16)."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

from trace_hf import HintBatch, HintRecorder, TraceFP4Config, fp4, use_hints
from trace_hf.data import arithmetic_dataset, format_prompt
from trace_hf.hints import hint_bytes_per_token, position_ids_from_mask
from trace_hf.hints.replay import Guide
from trace_hf.quant.experts import TraceFP4Experts
from trace_hf.testing import build_char_tokenizer, tiny_model


class CodeRecorder(HintRecorder):
    """A HintRecorder that also keeps the full rollout codes at hinted layers (for checking, not for use)."""

    def __enter__(self):
        self.codes = {i: [] for i in self.hint_layers}
        return super().__enter__()

    def record_input(self, site, q, hints=None):
        super().record_input(site, q, hints)
        self.codes[site.moe_layer].append(self._shape(q.codes()))


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def warmed(tokenizer, tmp_path_factory):
    """A tiny Qwen3 MoE briefly trained on the arithmetic fixture, so its next-token distributions are peaked."""
    model = tiny_model("qwen3_moe", tokenizer=tokenizer, seed=0, dtype=torch.float32)
    data = arithmetic_dataset(n_train=256, n_test=8, seed=1, max_operand=9)["train"]
    texts = [format_prompt(q) + " " + a + tokenizer.eos_token for q, a in zip(data["question"], data["answer"])]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        idx = torch.randint(len(texts), (16,), generator=g).tolist()
        enc = tokenizer([texts[i] for i in idx], return_tensors="pt", padding=True)
        labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
        loss = model(**enc, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    path = tmp_path_factory.mktemp("warm") / "model"
    model.to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    print(f"warm-up SFT final loss {loss.item():.3f}")
    return str(path)


def prompts(tokenizer, n=6):
    qs = arithmetic_dataset(n_train=n, n_test=1, seed=7, max_operand=9)["train"]["question"]
    # Different lengths: trim questions so left padding differs row to row.
    texts = [format_prompt(q[: 20 + 9 * i]) for i, q in enumerate(qs)]
    return tokenizer(texts, return_tensors="pt", padding=True)


def rollout(model, enc, recorder_cls=CodeRecorder, new_tokens=16, seed=0):
    model.eval()
    torch.manual_seed(seed)
    with recorder_cls(model) as rec:
        out = model.generate(
            **enc,
            max_new_tokens=new_tokens,
            do_sample=True,
            temperature=1.0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    seq = out.sequences
    mask = torch.cat([enc.attention_mask, torch.ones_like(seq[:, enc.input_ids.shape[1] :])], dim=1)
    logp = torch.stack(out.logits, 1).float().log_softmax(-1)
    logp = logp.gather(-1, seq[:, enc.input_ids.shape[1] :, None]).squeeze(-1)
    return rec, seq, mask, logp


def completion_logp(model, seq, mask, prompt_len, hints=None, replay=False, micro=2):
    """Training-side log-probs of the completion tokens: rows shuffled, split in `micro` micro-batches."""
    model.train()
    perm = torch.randperm(seq.shape[0], generator=torch.Generator().manual_seed(3))
    out = torch.empty(seq.shape[0], seq.shape[1] - prompt_len, device=seq.device)
    reports = []
    for rows in perm.chunk(micro):
        s, m = seq[rows], mask[rows]
        with torch.no_grad():
            if hints is None:
                logits = model(input_ids=s, attention_mask=m, position_ids=position_ids_from_mask(m)).logits
            else:
                with use_hints(model, hints[rows], m, routing_replay=replay) as rep:
                    logits = model(input_ids=s, attention_mask=m).logits
                reports.append(rep)
        lp = logits[:, prompt_len - 1 : -1].float().log_softmax(-1)
        out[rows] = lp.gather(-1, s[:, prompt_len:, None]).squeeze(-1)
    return out, reports


def test_hint_bytes_per_token_qwen35_35b_shape():
    # Qwen3.5-35B-A3B's shapes, config only: hidden 2048, 40 MoE layers, hints on the last 20.
    cfg = Qwen3_5MoeTextConfig(hidden_size=2048, num_hidden_layers=40, num_experts=256, num_experts_per_tok=8)
    assert hint_bytes_per_token(cfg, "nvfp4") == 7760 == 20 * (2048 // 8 + 2048 // 16 + 4)
    assert hint_bytes_per_token(cfg, "nvfp4", hint_layers=10) == 3880


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("dev", DEVICES)
def test_record_generate_and_replay_matches_rollout_codes(warmed, tokenizer, monkeypatch, dev):
    """On CUDA the rollout runs the fused Triton experts and training the torch path: different kernels, as with
    a separate inference engine."""
    model = AutoModelForCausalLM.from_pretrained(warmed, quantization_config=TraceFP4Config(), dtype=torch.bfloat16)
    model.to(dev)
    enc = prompts(tokenizer).to(dev)
    p = enc.input_ids.shape[1]
    rec, seq, mask, roll_logp = rollout(model, enc)
    hints = rec.collect(mask)
    assert isinstance(hints, HintBatch) and hints.hint_layers == (2, 3)
    # Positions by sample: real prompt tokens + every generated token but the last one fed back.
    assert torch.equal(hints.lengths, mask.sum(1) - 1)

    # Capture the codes the training forward actually used at hinted layers.
    seen = []
    original = Guide.experts_input

    def spy(self, x):
        seen.append((self.layer, fp4.guided_quantize(x.detach(), self.hints).codes(), self.has))
        return original(self, x)

    monkeypatch.setattr(Guide, "experts_input", spy)
    perm_logp, reports = completion_logp(model, seq, mask, p, hints=hints, replay=True)
    monkeypatch.undo()

    # Rollout codes by padded rollout column; training column c of row b holds position pos[c], which sat in the
    # rollout at the pos-th real column of the same sample.
    roll = {i: torch.cat(rec.codes[i], dim=1) for i in rec.hint_layers}
    perm = torch.randperm(seq.shape[0], generator=torch.Generator().manual_seed(3))
    n_layers = len(rec.hint_layers)
    equal = total = 0
    for k, rows in enumerate(perm.chunk(2)):
        m = mask[rows]
        pos = position_ids_from_mask(m)
        for layer, codes, has in seen[n_layers * k : n_layers * (k + 1)]:
            codes = codes.reshape(len(rows), m.shape[1], -1)
            has = has.reshape(len(rows), m.shape[1])
            for j, b in enumerate(rows.tolist()):
                real_cols = mask[b].bool().nonzero().flatten()
                c = has[j].nonzero().flatten()
                a, r = codes[j, c], roll[layer][b, real_cols[pos[j, c]]]
                same = (a == r) | (((a | r) & 7) == 0)  # +0 and -0 are the same value
                equal += int(same.sum())
                total += a.numel()
    rate = equal / total
    flip = sum(r.hint_flip_rate for r in reports) / len(reports)
    print(
        f"{dev}: hinted sites: training codes == rollout codes for {rate:.5f} of {total} elements; "
        f"nearest rounding would differ for {flip:.4f}"
    )
    assert total > 1000
    assert rate >= 0.999
    assert flip > 0  # there was something to correct


def logp_gaps(model, enc, hints_mode):
    p = enc.input_ids.shape[1]
    rec, seq, mask, roll_logp = rollout(model, enc, recorder_cls=HintRecorder, new_tokens=24)
    hints = rec.collect(mask) if hints_mode else None
    train_logp, reports = completion_logp(model, seq, mask, p, hints=hints, replay=hints_mode == "replay")
    d = (train_logp - roll_logp).abs()
    return d.mean().item(), d.max().item(), reports


@pytest.mark.parametrize("dev", DEVICES)
def test_hints_reduce_the_logp_gap(warmed, tokenizer, dev):
    enc = prompts(tokenizer, n=8).to(dev)
    fp4_model = AutoModelForCausalLM.from_pretrained(
        warmed, quantization_config=TraceFP4Config(), dtype=torch.bfloat16
    ).to(dev)
    bf16_model = AutoModelForCausalLM.from_pretrained(warmed, dtype=torch.bfloat16).to(dev)
    results = {"bf16": logp_gaps_plain(bf16_model, enc)}
    for mode in (None, "hints", "replay"):
        results[mode or "no hints"] = logp_gaps(fp4_model, enc, mode)[:2]
    for k, (mean, mx) in results.items():
        print(f"{dev}: |logp_train - logp_rollout| {k:>9}: mean {mean:.5f} max {mx:.4f}")
    excess = results["no hints"][0] - results["bf16"][0]
    removed = (results["no hints"][0] - results["hints"][0]) / excess if excess > 0 else float("nan")
    print(f"FP4-induced excess over BF16: {excess:.5f}; hints remove {removed:.0%} of it")
    assert results["hints"][0] < results["no hints"][0]
    assert results["replay"][0] < results["no hints"][0]


def logp_gaps_plain(model, enc):
    """BF16 floor: the same cached-decode vs full-forward comparison without any quantization."""
    model.eval()
    torch.manual_seed(0)
    out = model.generate(**enc, max_new_tokens=24, do_sample=True, output_logits=True, return_dict_in_generate=True)
    p = enc.input_ids.shape[1]
    seq = out.sequences
    mask = torch.cat([enc.attention_mask, torch.ones_like(seq[:, p:])], dim=1)
    roll = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, seq[:, p:, None]).squeeze(-1)
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    train = logits[:, p - 1 : -1].float().log_softmax(-1).gather(-1, seq[:, p:, None]).squeeze(-1)
    d = (train - roll).abs()
    return d.mean().item(), d.max().item()


def test_routing_replay_gives_the_rollout_top_k(warmed, tokenizer, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(warmed, quantization_config=TraceFP4Config(), dtype=torch.bfloat16)
    enc = prompts(tokenizer, n=8)
    rec, seq, mask, _ = rollout(model, enc, recorder_cls=HintRecorder, new_tokens=24)
    hints = rec.collect(mask)
    # One recorded route moved to other experts, so that replay must override the model's own choice there whatever
    # the CPU's thread count (one thread can make the rollout's and the training's routes agree everywhere).
    n_experts = model.config.num_experts
    hints.routing[0, 3, 0] = (hints.routing[0, 3, 0].long() + 1).remainder(n_experts).to(hints.routing.dtype)
    seen = {}
    original = TraceFP4Experts.forward

    def spy(self, hidden_states, top_k_index, top_k_weights):
        seen[self.moe_index] = top_k_index.clone()
        return original(self, hidden_states, top_k_index, top_k_weights)

    monkeypatch.setattr(TraceFP4Experts, "forward", spy)
    model.train()
    for replay in (False, True):
        with torch.no_grad(), use_hints(model, hints, mask, routing_replay=replay) as report:
            model(input_ids=seq, attention_mask=mask)
        pos = position_ids_from_mask(mask)
        has = (mask.bool() & (pos < hints.lengths[:, None])).flatten()
        pos = pos.clamp(max=hints.routing.shape[1] - 1)  # columns past the recorded range have no hint
        same = total = 0
        for layer, topk in seen.items():
            want = torch.gather(hints.routing[:, :, layer], 1, pos[..., None].expand(-1, -1, topk.shape[-1]))
            eq = (topk.sort(-1).values == want.flatten(0, 1).long().sort(-1).values).all(-1)
            same += int(eq[has].sum())
            total += int(has.sum())
        print(
            f"replay={replay}: training top-k == rollout top-k for {same / total:.4f} of {total} (token, layer); "
            f"own routing differs for {report.routing_mismatch:.4f}"
        )
        if replay:
            assert same == total
    assert report.routing_mismatch > 0


def test_gradient_checkpointing_sees_the_hints(warmed, tokenizer):
    enc = prompts(tokenizer, n=3)
    grads, losses, counts = [], [], []
    for ckpt in (False, True):
        model = AutoModelForCausalLM.from_pretrained(warmed, quantization_config=TraceFP4Config(), dtype=torch.float32)
        rec, seq, mask, _ = rollout(model, enc, recorder_cls=HintRecorder, new_tokens=8)
        hints = rec.collect(mask)
        model.train()
        if ckpt:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        with use_hints(model, hints, mask) as report:
            loss = model(input_ids=seq, attention_mask=mask, labels=seq).loss
            loss.backward()  # the recompute under checkpointing happens here, inside the block
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        assert report.hint_coverage > 0.8
        counts.append((report.flips, report.elements, int(report.routing_diff), int(report.routing_total)))
    assert losses[0] == losses[1]
    assert torch.equal(grads[0], grads[1])
    # The recompute is not counted again: the counts are the forward's, checkpointed or not.
    (flips, elements, diff, total), want = counts[1], counts[0]
    assert {k: int(v) for k, v in flips.items()} == {k: int(v) for k, v in want[0].items()}
    assert {k: int(v) for k, v in elements.items()} == {k: int(v) for k, v in want[1].items()}
    assert (diff, total) == want[2:] and total > 0 and sum(map(int, elements.values())) > 0


def test_hints_that_do_not_fit_raise(warmed, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(warmed, quantization_config=TraceFP4Config(), dtype=torch.float32)
    enc = prompts(tokenizer, n=2)
    rec, seq, mask, _ = rollout(model, enc, recorder_cls=HintRecorder, new_tokens=4)
    hints = rec.collect(mask)
    model.train()
    with pytest.raises(ValueError, match="hint rows"), use_hints(model, hints[:1], mask):
        pass
    shifted = HintBatch(*(getattr(hints, n) for n in HintBatch._TENSORS), hints.fmt, (3,))
    with pytest.raises(ValueError, match="MoE layers"), use_hints(model, shifted, mask):
        pass
    with pytest.raises(ValueError, match="tokens"), use_hints(model, hints, mask):
        model(input_ids=seq[:, :-2], attention_mask=mask[:, :-2])  # a forward the hints were not laid out for
    other = AutoModelForCausalLM.from_pretrained(warmed, quantization_config=TraceFP4Config(hint_layers=1))
    with pytest.raises(ValueError, match="hint_layers"), use_hints(other, hints, mask):
        pass
    model.train()
    with pytest.raises(RuntimeError, match="eval"), HintRecorder(model):
        pass


def test_hint_batch_rows_and_storage(warmed, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(warmed, quantization_config=TraceFP4Config(), dtype=torch.float32)
    enc = prompts(tokenizer, n=4)
    rec, seq, mask, _ = rollout(model, enc, recorder_cls=lambda m: HintRecorder(m, storage="cpu"), new_tokens=4)
    hints = rec.collect(mask)
    perm = torch.tensor([3, 1, 0, 2])
    sub = hints[perm]
    assert torch.equal(sub.lengths, hints.lengths[perm]) and torch.equal(sub.mantissa_bits[0], hints.mantissa_bits[3])
    inputs = hints.to_inputs()
    assert all(t.shape[0] == 4 for t in inputs.values())
    again = HintBatch.from_inputs(inputs, hints.fmt, hints.hint_layers)
    assert again.bytes_per_token() == hints.bytes_per_token() == 2 * (64 // 8 + 64 // 16 + 4)
    with pytest.raises(ValueError, match="storage"):
        HintRecorder(model, storage="disk")
