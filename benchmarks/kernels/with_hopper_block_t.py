# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Run a benchmark script with the Gluon experts' token block (`fp4_moe_configs.HOPPER` ``block_t``) set for every entry
above 8 slots, to see what 16-token blocks do when routing is skewed (many tokens per expert: each 8-token block
re-reads the expert's weights).

    python benchmarks/with_hopper_block_t.py 16 benchmarks/grpo_step.py --out outputs/grpo_bt16.json
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    block_t, script, rest = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    from trace_hf.kernels import fp4_moe_configs

    fp4_moe_configs.HOPPER[:] = [
        (lim, dict(cfg, block_t=block_t) if lim > 8 else cfg) for lim, cfg in fp4_moe_configs.HOPPER
    ]
    print("HOPPER:", fp4_moe_configs.HOPPER, flush=True)
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # the script's neighbours, as `python script` has
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
