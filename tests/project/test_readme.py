# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""README.md's Python snippets run as pasted: in order, in one session, on the tiny model (CPU, seconds)."""

import json
import os
import re

import pytest


README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


def snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", open(README, encoding="utf-8").read(), flags=re.S | re.M)


def test_readme_has_the_usage_snippets():
    found = snippets()
    assert len(found) == 6
    assert "save_tiny_model" in found[0] and "TraceGRPOTrainer" in found[1]
    assert "make_rollout" in found[2] and "use_hints" in found[3]
    assert 'format="compressed-tensors"' in found[4] and "freeze_experts" in found[5]


def test_readme_snippets_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the snippets write tiny-moe/ and outputs/ where they run
    namespace = {"__name__": "__readme__"}
    for i, code in enumerate(snippets()):
        try:
            exec(compile(code, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as e:  # name the block that failed
            pytest.fail(f"README.md python block {i + 1} raised {type(e).__name__}: {e}")
    # The GRPO snippet trained, and the no-TRL one measured hint flips and routing under replay.
    assert namespace["trainer"].state.global_step == 2
    out = namespace["out"]  # the rollout seam: ids, one log-prob per id, hints over every fed token
    assert [len(x) for x in out.logprobs] == [len(x) for x in out.completion_ids]
    assert out.hints is not None and len(out.hints) == 2
    qc = json.loads((tmp_path / "tiny-moe-nvfp4" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized"  # the served checkpoint, and RL restarted from it
    assert namespace["policy"].config.quantization_config.quant_method == "trace_fp4"
    metrics = namespace["report"].as_metrics()
    assert metrics["trace/hint_coverage"] > 0 and metrics["trace/routing_mismatch"] >= 0
    # Frozen FP4 experts + LoRA: one step, and the merged export reloads with frozen packed experts.
    assert namespace["lora_trainer"].state.global_step == 1
    from trace_hf.quant.experts import fp4_experts

    assert all(m.frozen for m in fp4_experts(namespace["policy"]))
