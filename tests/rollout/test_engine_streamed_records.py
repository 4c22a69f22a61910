# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""With hints kept in CPU memory (``storage="cpu"``), the engine streams its decode steps' records off the device
every ``record_window`` steps: the same `HintBatch` bit for bit as records kept on the device, assembled in CPU
memory, and a row counts only a window of records against the device, so more rows fit a wave (CPU, interpreter,
fp32, tiny models; on the GPU through the captured step)."""

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


def _model(family: str, device="cpu"):
    torch.manual_seed(0)
    model = T.tiny_model(family, num_hidden_layers=2)
    quantize_model(model, TraceFP4Config(hint_layers=2, hint_sites=SITES))
    return model.to(device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16).eval()


def _row_bytes(model, gc, P: int, window: int | None):
    from trace_hf.rollout.engine import kv_format, weights_from_hf
    from trace_hf.rollout.engine.runner import bytes_per_row
    from trace_hf.rollout.sampling import SamplingSettings

    s = SamplingSettings.from_generation_config(gc)
    return bytes_per_row(
        weights_from_hf(model), P + s.max_new_tokens, P, s, kv_format(model) is not None, True, window
    )


def _streamed(eng: EngineRollout) -> bool:
    return any(r.records.streams for r in eng._runners.values())


@pytest.mark.parametrize("family,stop", [("qwen3_moe", True), ("qwen3_5_moe_text", False)])
def test_streamed_records_are_the_device_records(family, stop):
    """Waves of 2 rows and 1 under a memory cap, windows of 3 steps, rows stopping at different steps (an EOS) with
    compaction, or all running to the end: every hint site and the routes equal the device records' bit for bit,
    whether a wave ends on a window's edge or inside one."""
    model = _model(family)
    prompts = random_prompts(model, (3, 2, 4))
    gc = greedy_config(max_new_tokens=8, eos_token_id=None)
    if stop:
        probe = EngineRollout()(model, prompts, gc)
        gc = greedy_config(max_new_tokens=8, eos_token_id=[probe.completion_ids[1][2]])  # row 1 stops at its 3rd
    limit = 2 * _row_bytes(model, gc, 4, None).total + 100
    on_device, streaming = (EngineRollout(memory_limit=limit, record_window=3) for _ in range(2))
    a = on_device(model, prompts, gc, record=True, storage="device")
    b = streaming(model, prompts, gc, record=True, storage="cpu")
    assert streaming.stats.waves == on_device.stats.waves == 2
    assert _streamed(streaming) and not _streamed(on_device)
    assert (len({len(c) for c in a.completion_ids}) > 1) == stop
    assert_same_rollout(a, b, record=True)
    assert b.hints.mantissa_bits.device.type == "cpu" and b.hints.site_hints["kv"][0].device.type == "cpu"


def test_a_window_admits_more_rows_and_short_completions_keep_theirs():
    """A row counts a window of records against the device, not its whole completion's: under a cap that fits 4
    such rows, one wave of 4 with storage="cpu" and two waves of 2 with the records on the device. Completions no
    longer than the window never stream."""
    model = _model("qwen3_5_moe_text")
    prompts = random_prompts(model, (2,) * 4)
    gc = greedy_config(max_new_tokens=4, eos_token_id=None)
    full, windowed = _row_bytes(model, gc, 2, None), _row_bytes(model, gc, 2, 1)
    assert full.decode > windowed.decode and full.prefill == windowed.prefill
    limit = windowed.total * 4
    assert full.total * 4 > limit
    on_device, streaming = (EngineRollout(memory_limit=limit, record_window=1) for _ in range(2))
    on_device(model, prompts, gc, record=True, storage="device")
    streaming(model, prompts, gc, record=True, storage="cpu")
    assert (streaming.stats.waves, streaming.stats.rows_per_wave) == (1, 4)
    assert (on_device.stats.waves, on_device.stats.rows_per_wave) == (2, 2)
    short = EngineRollout(record_window=4)
    short(model, prompts[:1], gc, record=True, storage="cpu")
    assert not _streamed(short)
    with pytest.raises(ValueError, match="record_window=0"):
        EngineRollout(record_window=0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe_text"])
def test_streamed_records_through_the_captured_step(family):
    """bf16 on CUDA with graphs, 40 rows x 37 steps, some stopped early by an EOS, windows of 8: the captured step
    writes column ``step % window`` and the CPU records equal the device ones bit for bit (one engine, same rows)."""
    model = _model(family, "cuda")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, model.config.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 30, (40,), generator=g)]  # fmt: skip
    gc = greedy_config(max_new_tokens=38, eos_token_id=None)
    probe = EngineRollout()(model, prompts, gc)
    gc = greedy_config(max_new_tokens=38, eos_token_id=[probe.completion_ids[0][5]])
    eng = EngineRollout(record_window=8)
    for rows in (prompts, prompts[:6]):  # K/V hints read 8 rows at a time: several parts, and one
        a = eng(model, rows, gc, record=True, storage="device")
        b = eng(model, rows, gc, record=True, storage="cpu")
        assert _streamed(eng) and len({len(c) for c in a.completion_ids}) > 1
        a.hints = a.hints.to("cpu")
        assert_same_rollout(a, b, record=True)
