#!/usr/bin/env bash
# Device call h200_83 (one H200), issue 31: the Gluon down projection split over K at batch 1 (`split_k_down`,
# committed as 2): (1) the GPU tests of the Gluon expert kernels and the engine; (2) decode A/B at batch 1, 1K
# context, both precisions: split_k_down 1 (before), 2 (committed), 3 and 6.
#   OUT=$OUT bash docs/runs/h200_83/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 200 python3 -m pytest -v -m gpu -p no:cacheprovider \
  --rootdir="$OLDPWD" "$OLDPWD/tests/kernels/test_fp4_moe_hopper.py" "$OLDPWD/tests/kernels/test_fp4_moe.py" \
  "$OLDPWD/tests/rollout") > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; grep -E "FAILED|ERROR|rc=|passed|failed" "$R/gpu_tests.log" | cut -c1-200 | tail -n 8
echo "tests done at $((SECONDS - START)) s"
AB_ARGS="--setups fast_bf16,fast_fp4 --batches 1 --contexts 1024 --budget-s 60" \
VARIANTS='{"sd1": {"8": {"split_k_down": 1}}, "sd3": {"8": {"split_k_down": 3}}, "sd6": {"8": {"split_k_down": 6}}}' \
  OUT="$R" timeout $((570 - (SECONDS - START))) python3 -m benchmarks.kernels.hopper_ab > "$R/ab.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s"; grep -E "^(base|sd1|sd3|sd6) [12] " "$R/ab.log" | sed 's/\[.*\]//' | cut -c1-220
tar -czf "$OUT/h200_83.tar.gz" -C "$R" .
cp "$R/gpu_tests.log" "$R/hopper_ab.json" "$OUT/" 2>/dev/null
echo "total $((SECONDS - START)) s"
