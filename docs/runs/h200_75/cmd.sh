#!/usr/bin/env bash
# Device call h200_75 (one H200), issue 31: the WGMMA decode entries with `gate_first` and `maxnreg` 128 (h200_74) as
# committed. The GPU tests of the expert kernels; a register cap of 96 for the decode kernels (`HOPPER`, 5 programs
# per SM instead of 4) at batch 64 and 128 (A/B, two rounds); the goal table of issue 31 at 1K context (fast BF16 and
# fast FP4, one run); decode at 8K context (BF16's best batch and FP4's).
#   OUT=$OUT bash docs/runs/h200_75/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider \
  --rootdir="$OLDPWD" "$OLDPWD/tests/kernels/test_fp4_moe_wgmma.py" "$OLDPWD/tests/kernels/test_fp4_moe_hopper.py" \
  "$OLDPWD/tests/kernels/test_fp4_moe.py") > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; grep -E "FAILED|ERROR|rc=|passed|failed" "$R/gpu_tests.log" | cut -c1-200 | tail -n 6
echo "tests done at $((SECONDS - START)) s"
AB_ARGS="--setups fast_fp4 --batches 64,128 --contexts 1024" \
  VARIANTS='{"r96": {"256": {"maxnreg": 96}, "1024": {"maxnreg": 96}}, "r96_1024": {"1024": {"maxnreg": 96}}}' \
  OUT="$R" timeout 120 python3 -m benchmarks.kernels.hopper_ab > "$R/ab.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s"; grep -E "^(base|r96)" "$R/ab.log" | sed -E 's/\[\(.*\)\] //' | cut -c1-250
rm -f "$R"/ab_*_?.json
timeout 170 python3 -m benchmarks.rollout.rollout_decode --setups fast_bf16,fast_fp4 --batches 1,64,128,192,256,512 \
  --contexts 1024 --budget-s 160 --out "$R/rollout_decode.json" > "$R/rollout_decode.log" 2>&1
echo "decode 1K rc=$? at $((SECONDS - START)) s"; grep -E "^setup=" "$R/rollout_decode.log" | cut -c1-120
timeout 150 python3 -m benchmarks.rollout.rollout_decode --setups fast_bf16,fast_fp4 --batches 96,384,512 \
  --contexts 8192 --budget-s 140 --out "$R/decode_8k.json" > "$R/decode_8k.log" 2>&1
echo "decode 8K rc=$? at $((SECONDS - START)) s"; grep -E "^setup=" "$R/decode_8k.log" | cut -c1-120
tar -czf "$OUT/h200_75.tar.gz" -C "$R" .
cp "$R/gpu_tests.log" "$R/rollout_decode.json" "$R/decode_8k.json" "$OUT/" 2>/dev/null
[ -f "$R/hopper_ab.json" ] && cp "$R/hopper_ab.json" "$OUT/"
echo "total $((SECONDS - START)) s"
