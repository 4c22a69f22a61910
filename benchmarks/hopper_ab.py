# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Decode throughput under variants of the Gluon kernels' launch settings (the experts' table `fp4_moe.HOPPER`, the
attention's `fp4_attention.CONFIG["hopper"]`), in one process: each variant in turn, twice (the repeat shows the
spread), each a `rollout_decode.py` run with the arguments in AB_ARGS.

    AB_ARGS="--setups fast_fp4 --batches 1,64 --contexts 1024" \\
    VARIANTS='{"xs": {"*": {"x_shared": true}}, "bk128": {"1024": {"block_k": 128}}}' \\
    OUT=outputs/ab python benchmarks/hopper_ab.py

VARIANTS maps a name to a patch: ``{limit: {key: value}}`` updates the `HOPPER` entry of that slot limit, ``"*"``
every entry, ``"attention"`` the attention's settings (e.g. ``{"attention": {"target_programs": 1584}}``),
``"hidden"`` batch 1's hidden-activation launch (`fp4_moe.HIDDEN_LAUNCH`), ``"quant"`` the quantization kernels'
launch settings (`fp4_quant.CONFIG`). A variant ``base`` (the settings as committed) always runs first. Writes
$OUT/hopper_ab.json: tokens/s per variant, round and cell.
"""

from __future__ import annotations

import json
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rollout_decode  # noqa: E402

from trace_hf.kernels import fp4_attention, fp4_moe, fp4_quant  # noqa: E402


def patched(table: list, patch: dict) -> list:
    """`HOPPER` with ``patch`` applied (see the module docstring); an unknown limit is an error, not a no-op."""
    limits = {str(lim) for lim, _ in table}
    unknown = set(patch) - limits - {"*", "attention", "hidden", "quant"}
    if unknown:
        raise SystemExit(f"VARIANTS names slot limits {sorted(unknown)}; HOPPER has {sorted(limits)} (or use '*').")
    return [(lim, {**cfg, **patch.get("*", {}), **patch.get(str(lim), {})}) for lim, cfg in table]


def main() -> int:
    out = os.environ["OUT"]
    variants = {"base": {}, **json.loads(os.environ.get("VARIANTS", "{}"))}
    base, attn_base = list(fp4_moe.HOPPER), dict(fp4_attention.CONFIG["hopper"])
    hidden_base, quant_base = dict(fp4_moe.HIDDEN_LAUNCH), dict(fp4_quant.CONFIG)
    res = {}
    for rnd in (1, 2):
        for name, patch in variants.items():
            fp4_moe.HOPPER[:] = patched(base, patch)
            fp4_attention.CONFIG["hopper"] = {**attn_base, **patch.get("attention", {})}
            fp4_moe.HIDDEN_LAUNCH = {**hidden_base, **patch.get("hidden", {})}
            fp4_quant.CONFIG.update(quant_base, **patch.get("quant", {}))
            path = f"{out}/ab_{name}_{rnd}.json"
            rollout_decode.main(["--out", path, "--steps", "20"] + os.environ["AB_ARGS"].split())
            with open(path) as f:
                cells = json.load(f)["cells"]
            res[f"{name} {rnd}"] = {
                f"{c['setup']} b{c['batch']} t{c['context']}": c.get("tokens_per_s") for c in cells
            }
            print(name, rnd, fp4_moe.HOPPER, res[f"{name} {rnd}"], flush=True)
    fp4_moe.HOPPER[:] = base
    fp4_attention.CONFIG["hopper"] = attn_base
    fp4_moe.HIDDEN_LAUNCH = hidden_base
    fp4_quant.CONFIG.update(quant_base)
    with open(f"{out}/hopper_ab.json", "w") as f:
        json.dump({"variants": variants, "tokens_per_s": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
