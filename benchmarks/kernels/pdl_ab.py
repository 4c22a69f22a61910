# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Decode throughput with and without programmatic dependent launch (`trace_hf.kernels.pdl`), in one process:
on, off, on, off (the repeats show the spread), each a `benchmarks.rollout.rollout_decode` run with the arguments
in AB_ARGS, and ``--no-pdl`` for the off runs (the benchmark's own switch).

    AB_ARGS="--setups fast_bf16,fast_fp4 --batches 1,64 --contexts 1024" OUT=outputs/ab python -m benchmarks.kernels.pdl_ab

Writes $OUT/ab.json: tokens/s per setting and cell.
"""

from __future__ import annotations

import json
import os
import sys

from benchmarks.rollout import rollout_decode


def main() -> int:
    out = os.environ["OUT"]
    res = {}
    for name, on in (("on", True), ("off", False), ("on2", True), ("off2", False)):
        path = f"{out}/ab_{name}.json"
        rollout_decode.main(
            ["--out", path, "--steps", "20"] + ([] if on else ["--no-pdl"]) + os.environ["AB_ARGS"].split()
        )
        with open(path) as f:
            cells = json.load(f)["cells"]
        res[name] = {f"{c['setup']} b{c['batch']} t{c['context']}": c.get("tokens_per_s") for c in cells}
        print(name, res[name], flush=True)
    with open(f"{out}/ab.json", "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
