# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""How much of a BF16 model an AdamW step can move at a given learning rate (docs/results.md 6c).

The study's GRPO trainer keeps its weights in BF16 (no FP32 master copy), so an update smaller than half a BF16
unit in the last place of a weight rounds away. This counts, for the study's `--size mini` model at its
initialization, the fraction of weight elements that three AdamW steps on random gradients change at all:

    python examples/study/bf16_updates.py
"""

import importlib.util
import os

import torch
from transformers import AutoModelForCausalLM

from trace_hf.testing import build_char_tokenizer


def main() -> None:
    spec = importlib.util.spec_from_file_location("study", os.path.join(os.path.dirname(__file__), "study.py"))
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    torch.manual_seed(0)
    config = study.model_config("mini", build_char_tokenizer())
    init = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(torch.bfloat16).state_dict()
    for lr in (1e-5, 2e-5, 3e-5, 5e-5, 1e-4):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(init)
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
        changed = sum((p.detach() != b).sum().item() for p, b in zip(model.parameters(), before, strict=True))
        total = sum(p.numel() for p in model.parameters())
        print(f"lr {lr:g}: {changed / total:.1%} of the weight elements changed after 3 BF16 AdamW steps")


if __name__ == "__main__":
    main()
