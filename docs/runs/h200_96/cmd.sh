#!/usr/bin/env bash
# Run as: OUT=$OUT bash docs/runs/h200_96/cmd.sh, at commit 6908884.
# Device call h200_96 (issue 31): (1) the two attention split settings that lab-notes 15 left off until measured, each
# against the committed settings in one process, two rounds (benchmarks.kernels.hopper_ab): PDL for small split grids
# (batch 1 and 4, 1K) and the FP4 kernel's split count rounded up (64-192 rows, 8K and 32K); (2) the GPU tests of the
# kernels and the engine after session 23's refactor of the Gluon expert epilogues and the admission by distinct prompts.
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/r; mkdir -p "$R" "$OUT/pdl" "$OUT/splits"
AB_ARGS="--setups fast_bf16,fast_fp4 --batches 1,4 --contexts 1024 --steps 50" VARIANTS='{
 "pdl128": {"fp4_attention.CONFIG": {"split_pdl_max_programs": 128}},
 "pdl600": {"fp4_attention.CONFIG": {"split_pdl_max_programs": 600}}}' \
  OUT="$OUT/pdl" timeout 200 python3 -m benchmarks.kernels.hopper_ab > "$OUT/pdl/ab.log" 2>&1
echo "pdl rc=$? at $((SECONDS - START)) s"
grep -E "^(base|pdl)" "$OUT/pdl/ab.log" | sed -E 's/^([a-z0-9_]+ [12]) .*(\{.fast_.*)$/\1 \2/' | cut -c1-300
AB_ARGS="--setups fast_fp4 --batches 64,96,128,192 --contexts 8192,32768" VARIANTS='{
 "up": {"fp4_attention.CONFIG": {"hopper": {"round_splits_up": true}}}}' \
  OUT="$OUT/splits" timeout 200 python3 -m benchmarks.kernels.hopper_ab > "$OUT/splits/ab.log" 2>&1
echo "splits rc=$? at $((SECONDS - START)) s"
grep -E "^(base|up) " "$OUT/splits/ab.log" | sed -E 's/^([a-z0-9_]+ [12]) .*(\{.fast_.*)$/\1 \2/' | cut -c1-400
grep -hE "Error|error" "$OUT"/*/ab.log | head -5
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
T=$PWD/tests
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout $((580 - (SECONDS - START))) python3 -m pytest -q -m gpu \
  -p no:cacheprovider --rootdir="$OLDPWD" "$T/kernels/test_fp4_moe_wgmma.py" "$T/kernels/test_fp4_moe_hopper.py" \
  "$T/rollout/test_engine_waves.py" "$T/rollout/test_engine_shared_prefill.py" "$T/kernels/test_fp4_attention_hopper.py" \
  "$T/kernels/test_fp4_moe.py" "$T/kernels/test_fp4_attention.py" > "$OUT/gpu_tests.log" 2>&1)
echo "tests rc=$? at $((SECONDS - START)) s"; tail -3 "$OUT/gpu_tests.log"
echo "total $((SECONDS - START)) s"
