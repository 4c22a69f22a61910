#!/usr/bin/env bash
# Run as: OUT=$OUT bash docs/runs/h200_94/cmd.sh at commit eac5974 (main + branch b1fold e3d54ef + branch prefix 0243326;
# fused_split was reverted after this run: it lost 1.6% at batch 1).
# Device call h200_94 (issue 31), branch int = main + b1fold + prefix:
# (1) docs/runs/h200_94/b1fold.sh: GPU bit tests of `fused_split` (batch 1's split-K finish inside the gate/up launch) and the
#     hopper tests; A/B at batch 1 (base / fold / fold with split-K 2), BF16 in the same runs;
# (2) gpu/prefix.sh: GPU tests of the shared prefill (load_fp4_kv with source rows, the engine shared vs not, the
#     decode step) and the 8-layer long-tailed GRPO step with the prompt prefill shared.
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
sed 's/--setups fast_fp4 --batches 1 /--setups fast_bf16,fast_fp4 --batches 1 /; s/timeout 90 python3 -m benchmarks.kernels.hopper_ab/timeout 150 python3 -m benchmarks.kernels.hopper_ab/' \
  docs/runs/h200_94/b1fold.sh > /tmp/b1fold.sh
OUT=$OUT bash /tmp/b1fold.sh
echo "b1fold done at $((SECONDS - START)) s"
OUT=$OUT bash docs/runs/h200_94/prefix.sh
echo "total $((SECONDS - START)) s"
