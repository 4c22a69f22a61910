# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`EngineRollout(share_prefill=True)`: each distinct prompt of a wave is prefilled once and its cache, first-token
logits and prompt hints go to every row with that prompt (GRPO's ``num_generations`` copies). With repeated prompts,
sharing on and off give the same tokens, log-probs and `HintBatch` per row (FP4 with every hint site, BF16 experts,
Qwen3.5's linear-attention states), while the prefill runs only the distinct rows; rows with one prompt still draw
independently. CPU: the interpreter, fp32, tiny models, the dense products made row by row (`batch_invariant`):
without it MKL sums some rows of the prefill's q/k/v, o_proj, router and lm_head products otherwise in a product of
3 prompts' tokens than of 7 (fp32 log-probs and the hints' fp32 row scales then differ in their last bits; the
tokens here do not), which is the batch shape's doing, not the sharing's (cuBLAS does the same on the GPU)."""

from __future__ import annotations

import pytest
import torch
from rollout_inputs import assert_same_rollout, greedy_config, random_prompts

from trace_hf import TraceFP4Config
from trace_hf import testing as T
from trace_hf.quant.quantizer import quantize_model
from trace_hf.rollout import EngineRollout


pytest.importorskip("trace_hf.kernels.sampling")
pytestmark = pytest.mark.usefixtures("one_thread")

SITES = ["experts_input", "experts_hidden", "kv"]
#: Seven rows of three prompts (lengths 5, 3, 7), repeated out of order as TRL's shuffled batches may hold them.
ROWS = (0, 1, 0, 2, 1, 0, 2)
SAMPLED = {"do_sample": True, "temperature": 1.0, "top_k": 50, "max_new_tokens": 4, "eos_token_id": None}


def _model(family: str, fp4: bool):
    layers = 2 if family == "qwen3_5_moe_text" else 1  # Qwen3.5: linear attention, then full attention
    model = T.tiny_model(family, num_hidden_layers=layers)
    if fp4:
        quantize_model(model, TraceFP4Config(hint_layers=layers, hint_sites=SITES))
    return model.eval()


def _on_and_off(model, record: bool, **engine):
    """(output, stats, the rows of each prefill forward) with share_prefill on, then off, from the same torch seed
    (the sampler's seed)."""
    base = random_prompts(model, (5, 3, 7))
    prompts = [list(base[i]) for i in ROWS]
    outs = []
    for share in (True, False):
        eng = EngineRollout(share_prefill=share, **engine)
        rows = []
        hook = model.register_forward_pre_hook(
            lambda m, a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True
        )
        torch.manual_seed(0)
        try:
            outs.append((eng(model, prompts, greedy_config(**SAMPLED), record=record), eng.stats, rows))
        finally:
            hook.remove()
    return outs


@pytest.mark.parametrize(
    "family,fp4",
    [("qwen3_moe", True), ("qwen3_moe", False), ("qwen3_5_moe_text", True)],
    ids=["fp4", "bf16_experts", "qwen35_fp4"],
)
def test_shared_prefill_changes_no_row(batch_invariant, family, fp4):
    """Sampled rows: the same tokens, log-probs and (FP4: every site) hints with and without sharing; the prefill ran
    the three distinct prompts, not the seven rows; rows with one prompt drew apart."""
    model = _model(family, fp4)
    (on, st_on, rows_on), (off, st_off, rows_off) = _on_and_off(model, record=fp4)
    assert_same_rollout(on, off, record=fp4)
    assert rows_on == [3] and rows_off == [len(ROWS)]  # the model's forwards: the prefill only (the engine decodes)
    assert st_on.prefill_rows == 3 and st_off.prefill_rows == len(ROWS)
    assert len({tuple(on.completion_ids[b]) for b in (0, 2, 5)}) > 1  # one prompt, independent draws


def test_shared_prefill_per_wave(batch_invariant):
    """Waves of at most four rows (0, 1, 0, 2 and 1, 0, 2): each wave prefills its own distinct prompts (3 + 3)."""
    model = _model("qwen3_moe", False)
    (on, st_on, rows_on), (off, st_off, rows_off) = _on_and_off(model, record=False, max_rows=4)
    assert st_on.waves == 2 and rows_on == [3, 3] and st_on.prefill_rows == 6
    assert rows_off == [4, 3] and st_off.prefill_rows == len(ROWS)
    assert_same_rollout(on, off, record=False)


def test_trainer_passes_share_prefill_to_the_engine(engine_grpo_step):
    """`TraceGRPOConfig.rollout_share_prefill` reaches the engine: the step's two rows (one prompt, two generations)
    prefill one row with it, two without."""
    for share, rows in ((True, 1), (False, 2)):
        model = quantize_model(T.tiny_model(num_hidden_layers=1), TraceFP4Config(hint_layers=1))
        trainer, _, changed = engine_grpo_step(model, rollout_share_prefill=share)
        assert trainer.rollout.share_prefill is share and trainer.rollout.stats.prefill_rows == rows
        assert changed


@pytest.mark.gpu
@pytest.mark.parametrize("fp4", [True, False], ids=["fp4", "bf16"])
def test_shared_prefill_on_the_gpu(fp4):
    """On the GPU (bf16, CUDA graphs, the FP4 cache load kernel's shared rows): 16 prompts x 4 generations, sampled.
    The prefill runs 16 rows; against prefilling all 64 the rows agree but for bf16 near-ties that products over
    another number of rows may part (cuBLAS sums a row otherwise), and the records have the same layout."""
    model = _model("qwen3_moe", fp4).to(device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    base = [torch.randint(4, model.config.vocab_size, (int(n),), generator=g).tolist()
            for n in torch.randint(3, 30, (16,), generator=g)]  # fmt: skip
    prompts = [p for p in base for _ in range(4)]
    gc = greedy_config(do_sample=True, temperature=1.0, max_new_tokens=24, eos_token_id=None)
    outs = {}
    for share in (True, False):
        eng = EngineRollout(share_prefill=share)
        torch.manual_seed(1)
        outs[share] = (eng(model, prompts, gc, record=fp4), eng.stats)
    (a, st_a), (b, st_b) = outs[True], outs[False]
    assert st_a.prefill_rows == 16 and st_b.prefill_rows == 64
    same = sum(x == y for x, y in zip(a.completion_ids, b.completion_ids, strict=True))
    assert same >= 0.9 * len(prompts), same
    assert len({tuple(a.completion_ids[r]) for r in range(4)}) > 1  # one prompt, independent draws
    if fp4:
        assert a.hints.mantissa_bits.shape == b.hints.mantissa_bits.shape and a.hints.sites == b.hints.sites
        assert torch.equal(a.hints.lengths, b.hints.lengths)
    print(f"shared prefill on the GPU ({'fp4' if fp4 else 'bf16'}): {same}/{len(prompts)} rows the same")
