#!/usr/bin/env bash
# Run as: OUT=$OUT bash docs/runs/h200_95/cmd.sh at commit b47f67c.
# Device call h200_95 (issue 31): the 32K goal re-measured at main's code (last measured in h200_44): BF16's best
# batch there (20 rows; 64 do not fit) against FP4 at 64, 96 and 128 rows, 48 layers.
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/r; mkdir -p "$R"
timeout 70 python3 -m benchmarks.rollout.rollout_decode --setups fast_bf16 --batches 20 --contexts 32768 --steps 10 \
  --budget-s 60 --out "$OUT/bf16_32k.json" > "$R/bf16.log" 2>&1
echo "bf16 rc=$? at $((SECONDS - START)) s"; grep -E "^setup=" "$R/bf16.log" | cut -c1-120
timeout $((200 - (SECONDS - START))) python3 -m benchmarks.rollout.rollout_decode --setups fast_fp4 --batches 64,96,128 \
  --contexts 32768 --steps 10 --budget-s 120 --out "$OUT/fp4_32k.json" > "$R/fp4.log" 2>&1
echo "fp4 rc=$? at $((SECONDS - START)) s"; grep -E "^setup=" "$R/fp4.log" | cut -c1-120
echo "total $((SECONDS - START)) s"
