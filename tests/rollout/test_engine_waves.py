# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The engine admits as many rows as fit and runs the rest in waves (CPU, interpreter, fp32, tiny model; the
memory cap simulated by `EngineRollout(memory_limit=...)`): the same tokens, log-probs and hints per row as one
batch of all rows; a row that cannot fit at all is an error naming the knob; row buckets up to 512 and past."""

from __future__ import annotations

import os

import pytest
import torch
from rollout_inputs import greedy_config, random_prompts

from trace_hf import TraceFP4Config
from trace_hf import testing as T
from trace_hf.quant.quantizer import quantize_model
from trace_hf.rollout import EngineRollout


pytest.importorskip("trace_hf.kernels.sampling")
pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = (5, 3, 7, 4, 6)  # prompt lengths


def _model(fp4: bool):
    torch.manual_seed(0)
    model = T.tiny_model(num_hidden_layers=2)
    if fp4:
        quantize_model(model, TraceFP4Config(hint_layers=2, hint_sites=["experts_input", "experts_hidden", "kv"]))
    return model.eval()


def _prompts(model):
    return random_prompts(model, ROWS)


def _gc(**kw):
    return greedy_config(**{"max_new_tokens": 6, **kw})


def _row_bytes(model, gc, record: bool, P: int = max(ROWS)):
    """What one row takes, as the engine counts it (`bytes_per_row`: decoding, and its prefill)."""
    from trace_hf.rollout.engine import kv_format, weights_from_hf
    from trace_hf.rollout.engine.runner import bytes_per_row
    from trace_hf.rollout.sampling import SamplingSettings

    s = SamplingSettings.from_generation_config(gc)
    return bytes_per_row(weights_from_hf(model), P + s.max_new_tokens, P, s, kv_format(model) is not None, record)


def _per_row(model, gc, record: bool) -> int:
    """One row prefilled on its own: with distinct prompts, every row."""
    return _row_bytes(model, gc, record).total


def test_row_buckets_up_to_512_and_past():
    from trace_hf.rollout.engine.runner import largest_bucket, row_bucket

    assert [row_bucket(n) for n in (1, 2, 3, 5, 9, 26, 33, 64, 65, 129, 150, 200, 257, 384, 511, 512, 513)] == [
        1, 2, 4, 8, 16, 32, 40, 64, 80, 160, 160, 224, 320, 384, 512, 512, 576,
    ]  # fmt: skip
    assert [largest_bucket(n) for n in (7, 26, 55, 63, 64, 127, 130, 170)] == [4, 24, 48, 56, 64, 112, 128, 160]
    for n in range(1, 1100):
        b = row_bucket(n)
        pad = 8 if n <= 64 else 16 if n <= 128 else 32 if n <= 256 else 64
        assert n <= b < 2 * n and (n <= 8 or b < n + pad)
        assert n <= 64 or b - n <= n // 4  # past 64 rows, at most a quarter of them in padding
        assert largest_bucket(b) == b and largest_bucket(n) <= n < 2 * largest_bucket(n)
        assert row_bucket(largest_bucket(n)) == largest_bucket(n)  # what admission picks is a bucket
    assert largest_bucket(0) == 0
    with pytest.raises(ValueError, match="at least one row"):
        row_bucket(0)


def test_waves_give_the_rows_of_one_batch():
    """Greedy, FP4 experts and KV cache, every hint site recorded, rows stopping at different lengths: waves of 3
    and 2 rows (a memory cap of 3 rows) give each row the tokens of one batch of all 5, and its log-probs and hints up to
    fp32 summation order. Greedy rows are independent, so a row that stops at an EOS is the one-batch row (decoded
    without that EOS) cut after it."""
    model = _model(True)
    prompts = _prompts(model)
    one = EngineRollout()(model, prompts, _gc(eos_token_id=None, max_new_tokens=5), record=True)
    eos = one.completion_ids[1][2]  # row 1 stops at its third token; the others where they meet it, or run on
    gc = _gc(eos_token_id=[eos], max_new_tokens=5)
    eng = EngineRollout(memory_limit=3 * _per_row(model, gc, True) + 100)
    waves = eng(model, prompts, gc, record=True)
    assert eng.stats.waves == 2 and eng.stats.rows_per_wave == 3 and len(eng.stats.steps) == 2
    cut = [c[: c.index(eos) + 1] if eos in c else c for c in one.completion_ids]
    assert waves.completion_ids == cut and len({len(c) for c in cut}) > 1
    for x, y, c in zip(waves.logprobs, one.logprobs, cut, strict=True):  # fp32 sums over batches of other shapes
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y[: len(c)]), rtol=0, atol=1e-5)
    a, b = waves.hints, one.hints
    n = a.lengths
    fed = torch.tensor([len(p) + len(c) for p, c in zip(prompts, cut, strict=True)])
    assert (n <= torch.minimum(b.lengths, fed)).all() and (n >= fed - 1).all()  # a row's last token is fed if
    # its wave decodes on after it
    keep = torch.arange(a.routing.shape[1])[None, :] < n[:, None]  # [rows, L]: the positions each row fed
    assert torch.equal(a.token_ids, b.token_ids[:, : a.token_ids.shape[1]] * keep)

    def same(x, y, exact=False):  # x: waves' [rows, L, ...], y: one batch's, compared where the rows fed tokens
        y = y[:, : x.shape[1]]
        m = keep.view(*keep.shape, *([1] * (x.ndim - 2))).expand_as(x)
        if exact:
            return (x[m] == y[m]).float().mean() > 0.999
        torch.testing.assert_close(x[m], y[m], rtol=1e-5, atol=0)
        return True

    pairs = [((a.mantissa_bits, a.block_scale, a.global_scale), (b.mantissa_bits, b.block_scale, b.global_scale))]
    pairs += [(a.site_hints[site], b.site_hints[site]) for site in ("experts_hidden", "kv")]
    for (bits, scale, g), (bits1, scale1, g1) in pairs:  # codes of inputs that differ in their last fp32 bits
        assert same(bits, bits1, exact=True) and same(scale, scale1, exact=True) and same(g, g1)
    assert same(a.routing, b.routing, exact=True)
    assert 0 < eng.stats.slot_occupancy < 1  # the rows that stopped early left their slots decoding padding


def test_max_rows_waves_and_sampling_seeds():
    """``max_rows`` caps a wave; sampled rows of the first wave draw what one batch draws in those slots, later
    waves draw with their own seed."""
    model = _model(False)
    prompts = _prompts(model)
    gc = _gc(do_sample=True, temperature=1.0, eos_token_id=None)
    torch.manual_seed(4)
    one = EngineRollout()(model, prompts, gc)
    eng = EngineRollout(max_rows=3)
    torch.manual_seed(4)
    waves = eng(model, prompts, gc)
    assert eng.stats.waves == 2 and eng.stats.rows_per_wave == 3
    assert waves.completion_ids[:3] == one.completion_ids[:3]
    assert waves.completion_ids[3:] != one.completion_ids[3:]
    assert all(len(c) == 6 for c in waves.completion_ids)


def test_a_shared_prefill_admits_more_rows():
    """GRPO's repeated prompts (4 prompts x 2): a wave prefills only its distinct prompts, so a memory cap of 4 rows
    decoding and 2 prefills runs 2 waves of 4 rows with ``share_prefill``, and 3 waves of 3 (3 prefills each)
    without it. Greedy, both give every row the same tokens."""
    model = _model(True)
    base = random_prompts(model, (6, 6, 6, 6))
    prompts = [p for p in base for _ in range(2)]
    gc = _gc(eos_token_id=None)
    rb = _row_bytes(model, gc, True, P=6)
    assert 0 < rb.prefill < rb.decode
    limit = rb.wave(4, 2)
    shared, unshared = (EngineRollout(memory_limit=limit, share_prefill=on) for on in (True, False))
    a, b = shared(model, prompts, gc, record=True), unshared(model, prompts, gc, record=True)
    assert (shared.stats.waves, shared.stats.rows_per_wave, shared.stats.prefill_rows) == (2, 4, 4)
    assert (unshared.stats.waves, unshared.stats.rows_per_wave, unshared.stats.prefill_rows) == (3, 3, 8)
    assert a.completion_ids == b.completion_ids


def test_bucketed_admission_arithmetic():
    """What a CUDA device admits (buckets of 32 rows from 128 to 256, of 64 above; `memory_limit` set, so nothing is
    measured): a wave's bucket rows decode and its prefilled prompts wait to be copied in. 300 distinct prompts under
    192 decoding rows' and 150 prefills' bytes: 2 waves of 150 in buckets of 160; 75 prompts x 4 with room for 320
    decoding rows and 75 prefills: one wave of 300 in a bucket of 320, which unshared would need 2 waves."""
    from trace_hf.rollout.engine.runner import RowBytes

    cuda = torch.device("cuda")  # only its type is read
    rb = RowBytes(decode=100, prefill=10)
    distinct = [[i] for i in range(300)]
    repeated = [[i // 4] for i in range(300)]
    cap = EngineRollout(memory_limit=rb.wave(192, 150))
    assert cap._waves(distinct, rb, 1, 8, cuda) == (150, 160, rb.wave(160, 150))
    cap = EngineRollout(memory_limit=rb.wave(320, 75))
    assert cap._waves(repeated, rb, 1, 8, cuda) == (300, 320, rb.wave(320, 75))
    unshared = EngineRollout(memory_limit=rb.wave(320, 75), share_prefill=False)
    assert unshared._waves(repeated, rb, 1, 8, cuda) == (150, 160, rb.wave(160, 150))
    assert EngineRollout(memory_limit=rb.total)._waves(distinct, rb, 1, 8, cuda) == (1, 1, rb.total)
    with pytest.raises(torch.OutOfMemoryError, match="Raise memory_limit"):
        EngineRollout(memory_limit=rb.total - 1)._waves(distinct, rb, 1, 8, cuda)


def test_a_row_that_cannot_fit_names_the_knob():
    model = _model(False)
    gc = _gc()
    eng = EngineRollout(memory_limit=_per_row(model, gc, False) - 1)
    with pytest.raises(torch.OutOfMemoryError, match=r"cannot fit one row .* Raise memory_limit"):
        eng(model, _prompts(model), gc)
    with pytest.raises(ValueError, match="max_rows=0"):
        EngineRollout(max_rows=0)


@pytest.mark.gpu
def test_waves_and_large_buckets_on_the_gpu():
    """On the GPU (bf16, CUDA graphs): 300 rows decode in one bucket of 320; capped at 150 rows' memory they run in
    2 waves of 150 in buckets of 160, and the rows agree with the one batch's (bf16 sums over other batch shapes
    may part a near-tie, so nearly all, not all)."""
    model = _model(True).to(device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, model.config.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 40, (300,), generator=g)]  # fmt: skip
    gc = _gc(max_new_tokens=12)
    eng = EngineRollout()
    one = eng(model, prompts, gc, record=True)
    assert eng.stats.waves == 1 and eng.stats.bucket_rows == 320
    from trace_hf.rollout.engine import kv_format, weights_from_hf
    from trace_hf.rollout.engine.runner import bytes_per_row
    from trace_hf.rollout.sampling import SamplingSettings

    s = SamplingSettings.from_generation_config(gc)
    P = max(len(p) for p in prompts)
    per_row = bytes_per_row(weights_from_hf(model), 256, P, s, kv_format(model) is not None, True)  # length bucket
    small = EngineRollout(memory_limit=per_row.wave(192, 192))
    waves = small(model, prompts, gc, record=True)
    assert small.stats.waves == 2 and small.stats.rows_per_wave == 150 and small.stats.bucket_rows == 160
    same = sum(a == b for a, b in zip(waves.completion_ids, one.completion_ids, strict=True))
    assert same >= 0.95 * len(prompts), same
    assert waves.hints.lengths.shape == one.hints.lengths.shape


def test_trainer_passes_the_admission_knobs_to_the_engine(engine_grpo_step):
    """`TraceGRPOConfig.rollout_max_rows` / `rollout_free_memory_fraction` / `rollout_compaction` reach the engine:
    one row per wave rolls the step's two rows out in two waves, and the step still trains."""
    model = quantize_model(T.tiny_model(num_hidden_layers=2), TraceFP4Config(hint_layers=1))
    trainer, logged, changed = engine_grpo_step(model, rollout_max_rows=1, rollout_free_memory_fraction=0.5,
                                                rollout_compaction=False)  # fmt: skip
    assert trainer.rollout.max_rows == 1 and trainer.rollout.free_memory_fraction == 0.5
    assert trainer.rollout.compaction is False and trainer.rollout.stats.compactions == 0
    assert trainer.rollout.stats.waves == 2 and trainer.rollout.stats.rows_per_wave == 1
    assert changed


@pytest.mark.parametrize("field,value", [("rollout_max_rows", 0), ("rollout_free_memory_fraction", 1.5)])
def test_bad_admission_knobs_are_refused_naming_the_field(field, value, tmp_path):
    from trace_hf import TraceGRPOConfig

    with pytest.raises(ValueError, match=field):
        TraceGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **{field: value})


def _expandable_from_env() -> bool:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


@pytest.mark.gpu
@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable_segments"])
def test_admission_leaves_out_the_allocators_fragments(expandable):
    """A 1 GiB segment cached unused counts as free (the engine hands it back before building a bucket). Once a 64 MiB
    tensor is carved from it, the other 960 MiB is a fragment no cache of a GiB can use, and no longer counts; with
    expandable segments (examples/grpo.py's default) a GiB cache can still grow into it, so it stays free."""
    from trace_hf.rollout.engine.planner import free_bytes

    dev = torch.device("cuda")
    torch.cuda.empty_cache()
    torch.cuda.memory._set_allocator_settings(f"expandable_segments:{expandable}")
    try:
        torch.cuda.empty_cache()
        before = free_bytes(dev)
        big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
        del big
        assert abs(free_bytes(dev) - before) < 4 << 20
        small = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
        split = torch.cuda.memory_stats(dev)["inactive_split_bytes.all.current"]
        if expandable:
            assert abs(free_bytes(dev) - (before - (64 << 20))) < 4 << 20
        else:
            assert split >= (1 << 30) - (64 << 20)
            assert abs(free_bytes(dev) - (before - (1 << 30))) < 4 << 20
        del small
    finally:
        torch.cuda.empty_cache()
        torch.cuda.memory._set_allocator_settings(f"expandable_segments:{_expandable_from_env()}")
