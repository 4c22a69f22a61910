# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""examples/grpo.py: regimes side by side, TensorBoard offline, runs never overwritten, the CPU mismatch."""

import glob
import importlib.util
import json
import os

import pytest
import torch
from accelerate import PartialState

from trace_hf import testing as T


PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def grpo():
    spec = importlib.util.spec_from_file_location("grpo_example", os.path.join(PROJECT_ROOT, "examples", "grpo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rollout_takes_all_or_a_list(grpo):
    assert grpo.parse_args([]).regimes == ["bf16", "naive", "fp4", "trace"]
    assert grpo.parse_args(["--rollout", "trace,bf16,trace"]).regimes == ["trace", "bf16"]
    assert grpo.parse_args(["--rollout-engine", "generate"]).rollout_engine == "generate"
    assert grpo.parse_args(["--report-to", "tensorboard,wandb"]).report_to == ["tensorboard", "wandb"]
    with pytest.raises(SystemExit):
        grpo.parse_args(["--rollout", "fp4,fp8"])


def test_an_existing_run_is_refused_without_overwrite(grpo, tmp_path):
    args = grpo.parse_args(["--output-dir", str(tmp_path), "--run-name", "r"])
    run = grpo.prepare_run_dir(args, PartialState())
    open(os.path.join(run, "table.md"), "w").close()
    with pytest.raises(SystemExit, match="--overwrite"):
        grpo.prepare_run_dir(args, PartialState())
    assert os.path.exists(os.path.join(run, "table.md"))
    args.overwrite = True
    assert grpo.prepare_run_dir(args, PartialState()) == run and os.listdir(run) == []
    args.run_name = None  # default: the start time, a new folder
    assert grpo.prepare_run_dir(args, PartialState()) != run


def test_split_attention_is_the_same_math_and_rounds_differently_in_bf16(grpo):
    """The CPU default's mismatch: eager attention in eval (rollout), SDPA in training. In fp32 both agree (so the
    mask handling is right: causal, left padding); in BF16 they differ by rounding, which is what FP4 amplifies."""
    attn = grpo.register_split_attention()
    tok = T.build_char_tokenizer()
    batch = tok(["Q: 3+4\nA: 7", "Q: 12+30\nA: 42"], return_tensors="pt", padding=True)
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    real = batch.attention_mask.bool()

    def logits(dtype, training):
        model = T.tiny_model(tokenizer=tok, dtype=dtype, attn_implementation=attn)
        model.train(training)
        with torch.no_grad():
            return model(**batch, position_ids=positions).logits.float()[real]

    torch.testing.assert_close(logits(torch.float32, False), logits(torch.float32, True), rtol=1e-5, atol=1e-5)
    diff = (logits(torch.bfloat16, False) - logits(torch.bfloat16, True)).abs().max()
    assert 0 < diff < 0.1


def test_regimes_share_a_start_and_report_one_table_plot_and_tensorboard(grpo, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = grpo.main(
        ["--rollout", "bf16,trace", "--output-dir", str(tmp_path), "--run-name", "r", "--max-steps", "2"]
        + ["--sft-steps", "2", "--prompts-per-step", "2", "--num-generations", "4", "--max-completion-length", "3"]
        + ["--report-to", "tensorboard"]
    )
    run = out["run_dir"]
    bf16, trace = out["regimes"]
    assert (bf16["regime"], trace["regime"]) == ("bf16", "trace") and bf16["steps"] == trace["steps"] == 2
    assert len(os.listdir(os.path.join(tmp_path, "sft-warm"))) == 1  # one warm start for both
    with open(os.path.join(run, "trace", "metrics.json")) as f:
        history = json.load(f)
    assert [h["step"] for h in history if "reward" in h] == [1, 2]
    # Only the FP4 regime measures FP4 mismatch.
    assert "routing" in trace and "routing" not in bf16
    with open(os.path.join(run, "table.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) == 4 and "TRACE" in lines[3] and "n/a" in lines[2]
    assert os.path.getsize(os.path.join(run, "grpo.png")) > 10_000
    events = glob.glob(os.path.join(run, "trace", "runs", "*", "events.out.tfevents.*"))
    assert events, os.listdir(os.path.join(run, "trace"))
    acc = EventAccumulator(os.path.dirname(events[0]))
    acc.Reload()
    assert len(acc.Scalars("train/reward")) == 2
    assert any(tag.startswith("train/trace/") for tag in acc.Tags()["scalars"])
