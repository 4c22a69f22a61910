#!/usr/bin/env bash
# Device call h200_84 (one H200), issue 31: programmatic dependent launch by the decode step's rows
# (`pdl.CONFIG["max_rows"]`, `pdl.for_rows`): (1) the GPU tests of the decoder (PDL changes no bits); (2) decode A/B
# at batch 64-512, 1K context, both precisions: PDL at every batch (base) against PDL only up to 64 rows (m64).
#   OUT=$OUT bash docs/runs/h200_84/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 100 python3 -m pytest -v -m gpu -p no:cacheprovider \
  --rootdir="$OLDPWD" "$OLDPWD/tests/rollout/test_fast_decode.py") > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; grep -E "FAILED|ERROR|rc=|passed|failed" "$R/gpu_tests.log" | cut -c1-200 | tail -n 8
echo "tests done at $((SECONDS - START)) s"
AB_ARGS="--setups fast_bf16,fast_fp4 --batches 64,128,256,512 --contexts 1024 --budget-s 100" \
VARIANTS='{"m64": {"pdl.CONFIG": {"max_rows": 64}}}' \
  OUT="$R" timeout $((440 - (SECONDS - START))) python3 -m benchmarks.kernels.hopper_ab > "$R/ab.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s"; grep -E "^(base|m64) [12] " "$R/ab.log" | sed 's/\[.*\]//' | cut -c1-400
tar -czf "$OUT/h200_84.tar.gz" -C "$R" .
cp "$R/gpu_tests.log" "$R/hopper_ab.json" "$OUT/" 2>/dev/null
echo "total $((SECONDS - START)) s"
