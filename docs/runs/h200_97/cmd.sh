#!/usr/bin/env bash
# Run as: OUT=$OUT bash docs/runs/h200_97/cmd.sh, at commit 6908884.
# Device call h200_97 (issue 31): the FP4 attention's split count at 192-512 rows and 1K context (the 256-row goal),
# two rounds (benchmarks.kernels.hopper_ab): "rule", the fewest splits that reach 1,024 programs (what h200_96's
# rounding up suggests); "s2" and "s3", target_programs 2,048 and 3,072 rounded down (256 rows: 2 and 3 splits);
# then BF16's 256-row step once, for the ratio. Per-run files stay in /tmp (8 files come back at most).
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/r; mkdir -p "$R"
AB_ARGS="--setups fast_fp4 --batches 192,256,512 --contexts 1024" VARIANTS='{
 "rule": {"fp4_attention.CONFIG": {"hopper": {"target_programs": 1024, "round_splits_up": true}}},
 "s2": {"fp4_attention.CONFIG": {"hopper": {"target_programs": 2048}}},
 "s3": {"fp4_attention.CONFIG": {"hopper": {"target_programs": 3072}}}}' \
  OUT="$R" timeout 330 python3 -m benchmarks.kernels.hopper_ab > "$OUT/ab.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s"
grep -E "^(base|rule|s2|s3) " "$OUT/ab.log" | sed -E 's/^([a-z0-9_]+ [12]) .*(\{.fast_.*)$/\1 \2/' | cut -c1-300
grep -hE "Error|error" "$OUT/ab.log" | head -5
[ -f "$R/hopper_ab.json" ] && cp "$R/hopper_ab.json" "$OUT/"
timeout 90 python3 -m benchmarks.rollout.rollout_decode --setups fast_bf16 --batches 256 --contexts 1024 \
  --out "$OUT/bf16_256.json" > "$R/bf16.log" 2>&1
echo "bf16 rc=$? at $((SECONDS - START)) s"; grep -E "^setup=" "$R/bf16.log" | cut -c1-120
echo "total $((SECONDS - START)) s"
