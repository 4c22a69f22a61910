# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Live-row compaction in the rollout engine: once the rows of a wave still decoding fit a smaller bucket, they move
to the front and decode on there. Compaction on and off give the same tokens, log-probs, hints and routing per row,
in row order (greedy and sampled: the sampler's noise follows the row, not the slot); `EngineStats` shows the
compactions and what they saved. CPU: the interpreter, fp32, tiny models, with the dense products made row by row
(`batch_invariant`), so that a difference could only be the compaction's: the CPU's BLAS, like cuBLAS, may sum a
row otherwise when the batch is smaller."""

from __future__ import annotations

import collections

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
LENGTHS = (5, 3, 7, 4)  # prompt lengths: four rows, a bucket of 4 on CPU (2 and 1 below it)


def _qwen3(fp4: bool):
    model = T.tiny_model(num_hidden_layers=1)
    if fp4:
        quantize_model(model, TraceFP4Config(hint_layers=1, hint_sites=SITES))
    return model.eval()


def _on_and_off(model, prompts, gc, record: bool, seed: int = 0, **engine):
    """(output, stats) with compaction on, then off; the same torch seed before each (the sampler's seed)."""
    outs = []
    for compaction in (True, False):
        eng = EngineRollout(compaction=compaction, **engine)
        torch.manual_seed(seed)
        outs.append((eng(model, prompts, gc, record=record), eng.stats))
    return outs


def _stops_at_first_token(model, prompts, rows, gc, **engine):
    """EOS ids that stop ``rows`` at their first token (from a prefill-only rollout), and the rows' first tokens."""
    first = [c[0] for c in EngineRollout(**engine)(model, prompts, gc).completion_ids]
    return sorted({first[i] for i in rows}), first


def test_buckets_below():
    from trace_hf.rollout.engine.runner import buckets_below, row_bucket

    assert buckets_below(1) == [] and buckets_below(5) == [4, 2, 1]
    assert buckets_below(64) == [56, 48, 40, 32, 24, 16, 8, 4, 2, 1]
    assert buckets_below(320) == [256, 224, 192, 160, 128, 112, 96, 80, 64, 56, 48, 40, 32, 24, 16, 8, 4, 2, 1]
    for n in range(1, 300):
        assert buckets_below(n) == sorted({row_bucket(k) for k in range(1, n + 1)} - {row_bucket(n), n}, reverse=True)


def test_sampler_noise_follows_the_row():
    """`gumbel_argmax(..., rows=)`: a row moved to another slot draws what it drew in its own; without ``rows`` each
    row draws its own slot's noise."""
    from trace_hf.kernels.sampling import gumbel_argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=g) * 3
    seed, step = torch.tensor([123]), torch.tensor([4])
    own = gumbel_argmax(x, seed, step)
    perm = torch.tensor([4, 0, 5, 2, 1, 3])
    assert torch.equal(gumbel_argmax(x[perm], seed, step, rows=perm), own[perm])
    assert torch.equal(gumbel_argmax(x, seed, step, rows=torch.arange(6)), own)
    assert not torch.equal(gumbel_argmax(x[perm], seed, step), own[perm])  # the slot's noise would differ
    with pytest.raises(ValueError, match="rows must be int64"):
        gumbel_argmax(x, seed, step, rows=perm.int())


def test_compaction_changes_no_record(batch_invariant):
    """Greedy, FP4 experts and KV cache, every hint site: rows stopping at their 1st, 2nd and 3rd token and one
    running to the limit. Compaction moves the wave from 4 rows to 2, then 1, and every row's tokens, log-probs, hints
    (every site) and routing are exactly those without compaction; it decoded fewer row-steps."""
    model = _qwen3(True)
    prompts = random_prompts(model, LENGTHS)
    ref = EngineRollout()(model, prompts, greedy_config(max_new_tokens=5, eos_token_id=None)).completion_ids
    eos = sorted({ref[0][0], ref[1][1], ref[2][2]})
    want = [c[: next((j + 1 for j, t in enumerate(c) if t in eos), len(c))] for c in ref]
    (on, st_on), (off, st_off) = _on_and_off(model, prompts, greedy_config(max_new_tokens=5, eos_token_id=eos), True)
    assert [len(c) for c in want] == [1, 2, 3, 5] and on.completion_ids == want
    assert_same_rollout(on, off, record=True)
    assert st_off.compactions == 0 and st_off.buckets == [[(0, 4)]] and st_off.row_steps == 4 * st_off.steps[0]
    # A row retires with the step that feeds its EOS (decode step len - 1); at the next check the rest move down:
    # rows 0 and 1 are gone from step 2 on (bucket 2), row 2 from step 3 (bucket 1).
    assert st_on.buckets == [[(0, 4), (2, 2), (3, 1)]] and st_on.compactions == 2
    steps = [s for s, _ in st_on.buckets[0]] + [st_on.steps[0] - 1]
    assert st_on.row_steps == 4 + sum(b * (e - s) for (s, b), e in zip(st_on.buckets[0], steps[1:], strict=True))
    assert st_on.tokens == st_off.tokens == sum(map(len, want))
    assert st_on.padding_row_steps < st_off.padding_row_steps and st_on.slot_occupancy > st_off.slot_occupancy


def test_sampled_rows_draw_the_same_after_compaction(batch_invariant):
    """Sampling (temperature, top-k): two rows stop at their first token, the other two move into the first two
    slots and draw exactly what they draw without compaction (the noise is keyed by row, not slot)."""
    model = _qwen3(False)
    prompts = random_prompts(model, LENGTHS, seed=2)
    sampled = {"do_sample": True, "temperature": 1.0, "top_k": 50}
    torch.manual_seed(0)  # the seed `_on_and_off` draws with: the same first tokens
    eos, first = _stops_at_first_token(model, prompts, (0, 1), greedy_config(max_new_tokens=1, **sampled))
    assert first[2] not in eos and first[3] not in eos
    gc = greedy_config(max_new_tokens=5, eos_token_id=eos, **sampled)
    (on, st_on), (off, _) = _on_and_off(model, prompts, gc, False)
    assert [len(c) for c in on.completion_ids[:2]] == [1, 1] and st_on.compactions >= 1
    assert st_on.buckets[0][:2] == [(0, 4), (1, 2)]  # rows 2 and 3 decode in slots 0 and 1 from step 1 on
    assert_same_rollout(on, off, record=False)


def test_each_wave_compacts_in_its_own_rows(batch_invariant):
    """Two waves of two rows in one runner (sampling: wave k draws with seed + k): the first row of each wave stops
    at its first token and the second moves into slot 0; the next wave starts from the runner's rows in order
    again, and every row is what it is without compaction."""
    model = _qwen3(False)
    prompts = random_prompts(model, LENGTHS, seed=3)
    sampled = {"do_sample": True, "temperature": 1.0}
    torch.manual_seed(0)
    eos, first = _stops_at_first_token(model, prompts, (0, 2), greedy_config(max_new_tokens=1, **sampled), max_rows=2)
    assert first[1] not in eos and first[3] not in eos
    gc = greedy_config(max_new_tokens=4, eos_token_id=eos, **sampled)
    (on, st_on), (off, st_off) = _on_and_off(model, prompts, gc, False, max_rows=2)
    assert st_on.waves == 2 and st_on.buckets == [[(0, 2), (1, 1)], [(0, 2), (1, 1)]] and st_on.compactions == 2
    assert st_off.buckets == [[(0, 2)], [(0, 2)]]
    assert_same_rollout(on, off, record=False)


def test_qwen35_compaction_moves_the_recurrent_states(batch_invariant):
    """Qwen3.5 (Gated DeltaNet + gated attention), FP4, every site: rows 0 and 1 stop at their first token, rows 2
    and 3 move with their conv and recurrent states and K/V into slots 0 and 1; the same records as without."""
    model = T.tiny_model("qwen3_5_moe_text", num_hidden_layers=2)
    quantize_model(model, TraceFP4Config(hint_layers=2, hint_sites=SITES))
    model.eval()
    prompts = random_prompts(model, (6, 2, 9, 4))
    eos, first = _stops_at_first_token(model, prompts, (0, 1), greedy_config(max_new_tokens=1))
    assert first[2] not in eos and first[3] not in eos
    (on, st_on), (off, _) = _on_and_off(model, prompts, greedy_config(max_new_tokens=4, eos_token_id=eos), True)
    assert st_on.compactions >= 1 and st_on.buckets[0][1] == (1, 2)
    assert_same_rollout(on, off, record=True)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe_text"])
def test_compaction_graphs_match_eager_gpu(family):
    """On the GPU (bf16, CUDA graphs, FP4, every site, sampling; Qwen3 MoE and Qwen3.5): rows stopping at different
    steps, compaction through the smaller buckets' captured graphs gives exactly what the eager steps give; against
    no compaction the rows agree but for bf16 near-ties that products over fewer rows may part."""
    if family == "qwen3_moe":
        model = _qwen3(True)
    else:
        model = T.tiny_model(family, num_hidden_layers=2)
        quantize_model(model, TraceFP4Config(hint_layers=2, hint_sites=SITES))
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, model.config.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 30, (40,), generator=g)]  # fmt: skip
    gc = greedy_config(do_sample=True, temperature=1.0, max_new_tokens=48, eos_token_id=None)
    torch.manual_seed(1)
    ref = EngineRollout()(model, prompts, gc).completion_ids
    eos = []  # the most drawn ids, until three rows in four would stop within 24 tokens
    for t, _ in collections.Counter(t for c in ref for t in c).most_common():
        eos.append(t)
        if sum(any(x in eos for x in c[:24]) for c in ref) >= 0.75 * len(ref):
            break
    gc = greedy_config(do_sample=True, temperature=1.0, max_new_tokens=48, eos_token_id=eos)
    outs = {}
    for graphs, compaction in ((True, True), (False, True), (True, False)):
        eng = EngineRollout(use_graphs=graphs, compaction=compaction)
        torch.manual_seed(1)
        outs[graphs, compaction] = (eng(model, prompts, gc, record=True), eng.stats)
    (a, st), (b, _), (c, st_off) = outs[True, True], outs[False, True], outs[True, False]
    rows = [b for _, b in st.buckets[0]]
    assert rows[0] == 40 and len(rows) >= 2 and rows == sorted(rows, reverse=True) and st_off.compactions == 0
    assert_same_rollout(a, b, record=True)
    same = sum(x == y for x, y in zip(a.completion_ids, c.completion_ids, strict=True))
    assert same >= 0.9 * len(prompts), same
    assert st.slot_occupancy > st_off.slot_occupancy
    print("compaction on the GPU:", st.buckets, f"occupancy {st.slot_occupancy:.3f} vs {st_off.slot_occupancy:.3f}")
