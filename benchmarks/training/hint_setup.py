# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The host time of `use_hints`' setup, which `TraceGRPOTrainer` pays for every micro-batch of every log-prob and
training forward while the GPU waits: a model of ``--layers`` MoE layers (tiny widths: the setup's cost grows with
the number of modules, not their size) with PEFT LoRA on q/k/v/o, hints on half the layers, entered and left
``--iters`` times. Reports milliseconds per entry and how many times the setup walks the model's module tree.

    python -m benchmarks.training.hint_setup --layers 48 --out hint_setup.json   # any machine, ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from benchmarks import harness


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--iters", type=int, default=10)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # tiny CPU model; the rollout below runs eagerly
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from trace_hf import HintRecorder, TraceFP4Config, use_hints
    from trace_hf import testing as T

    with tempfile.TemporaryDirectory() as d:
        path = T.save_tiny_model(os.path.join(d, "m"), num_hidden_layers=args.layers)
        config = TraceFP4Config(hint_layers=args.layers // 2, freeze_experts=True)
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = peft.get_peft_model(model, lora)
    core = model.get_base_model().model
    ids = torch.randint(4, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    model.eval()
    with torch.no_grad(), HintRecorder(core) as rec:
        core(input_ids=ids, attention_mask=mask)
    hints = rec.collect(mask)
    model.train()

    walks = []
    original = torch.nn.Module.modules

    def counted(self):
        walks.append(self is core)
        return original(self)

    def enter_and_leave():
        with use_hints(core, hints, mask):
            pass

    torch.nn.Module.modules = counted
    try:
        enter_and_leave()
    finally:
        torch.nn.Module.modules = original
    seconds = harness.time_per_call(enter_and_leave, args.iters, warmup=1, cuda=False)
    res = {
        "layers": args.layers,
        "modules": sum(1 for _ in model.modules()),
        "ms_per_entry": seconds * 1e3,
        "walks_of_the_model_per_entry": sum(walks),
    }
    print(res)
    harness.write_json(args.out, {"args": vars(args), "result": res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
