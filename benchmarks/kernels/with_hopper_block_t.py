# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Run a benchmark with the Gluon experts' token block (`fp4_moe_configs.HOPPER` ``block_t``) set for every entry
above 8 slots, to see what 16-token blocks do when routing is skewed (many tokens per expert: each 8-token block
re-reads the expert's weights). The benchmark is a module name or a script path; it runs in this process under
`benchmarks.harness.override`.

    python -m benchmarks.kernels.with_hopper_block_t 16 benchmarks.training.grpo_step --out outputs/grpo_bt16.json
"""

from __future__ import annotations

import sys

from benchmarks import harness


def main() -> None:
    block_t, target, rest = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    from trace_hf.kernels import fp4_moe_configs

    table = [(lim, dict(cfg, block_t=block_t) if lim > 8 else cfg) for lim, cfg in fp4_moe_configs.HOPPER]
    with harness.override({"fp4_moe_configs.HOPPER": table}):
        print("HOPPER:", fp4_moe_configs.HOPPER, flush=True)
        harness.run_target(target, rest)


if __name__ == "__main__":
    main()
