# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Flip rate and routing mismatch of hints applied to the policy that recorded them, to that policy after small
updates, and to another policy of the same shape: what `use_hints`' off-policy warning is calibrated on.

    python -m benchmarks.mismatch.stale_hints   # CPU, tiny Qwen3 MoE from trace_hf.testing, a few seconds
"""

from __future__ import annotations

import argparse
import copy
import json
import warnings

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from trace_hf import TraceFP4Config, use_hints
from trace_hf.rollout import make_rollout
from trace_hf.testing import save_tiny_model


def rates(policy, trainer, prompts, settings) -> tuple[float, float]:
    """Roll out with `policy`, apply its hints in a training forward of `trainer`."""
    out = make_rollout(policy, "generate")(policy.eval(), prompts, settings, record=True)
    rows = [p + c for p, c in zip(prompts, out.completion_ids, strict=True)]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    trainer.train()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        with use_hints(trainer, out.hints, mask, routing_replay=False, apply_hints=False) as report:
            trainer(input_ids=ids, attention_mask=mask)
    return report.hint_flip_rate, report.routing_mismatch


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    results = {}
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        path = save_tiny_model(f"/tmp/stale-hints-{seed}", seed=seed)
        other = save_tiny_model(f"/tmp/stale-hints-{seed}-other", seed=seed + 1000)
        load = lambda q: AutoModelForCausalLM.from_pretrained(q, dtype=dtype, quantization_config=TraceFP4Config())  # noqa: E731
        policy = load(path)
        tok = AutoTokenizer.from_pretrained(path)
        prompts = [tok(f"Q: {a}+{b}\nA:")["input_ids"] for a, b in [(2, 3), (14, 27), (5, 9), (33, 8)] * 2]
        settings = GenerationConfig(max_new_tokens=16, do_sample=True, eos_token_id=[tok.eos_token_id])
        cases = {"same policy": policy}
        for rel in (1e-3, 1e-2, 1e-1):  # every weight moved by rel * its own magnitude (random sign): staler updates
            moved = copy.deepcopy(policy)
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for w in moved.parameters():
                    w.add_(w.abs().float().mul(rel) * torch.randn(w.shape, generator=g).sign().to(w.dtype))
            cases[f"weights moved {rel:g}"] = moved
        cases["another policy (other init)"] = load(other)
        for name, trainer in cases.items():
            torch.manual_seed(seed)
            results.setdefault(name, []).append(rates(policy, trainer, prompts, settings))
    print(f"| hints applied to | flip rate (mean, max over {args.seeds} seeds) | routing mismatch (mean, max) |")
    print("| --- | --- | --- |")
    for name, rs in results.items():
        f, r = [x for x, _ in rs], [y for _, y in rs]
        print(f"| {name} | {sum(f) / len(f):.3f}, {max(f):.3f} | {sum(r) / len(r):.3f}, {max(r):.3f} |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
    return results


if __name__ == "__main__":
    main()
