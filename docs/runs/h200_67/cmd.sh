#!/usr/bin/env bash
# Device call h200_67 (one H200), issue 32 with h200_66's sweeps applied (gated_delta.CONFIG 64 columns / 2 warps;
# the FP4-KV Gluon attention's `wide_heads` entry for 256-wide heads): the 40-layer decode at 64 x 1K and each
# setup's best batch at 32K, then the GPU tests of the attention kernels, the Qwen3.5 engine and the Qwen3 decode
# step. From the root:
#   OUT=$OUT bash docs/runs/h200_67/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
timeout 110 python3 -m benchmarks.rollout.decode_qwen35 --profile --layers 40 --setups bf16_triton,fp4_triton \
  --cells 64x1024,96x32768,384x32768,448x32768 --out "$R/q35_40l.json" > "$R/q35_40l.log" 2>&1
echo "rc=$? after $((SECONDS - START)) s" >> "$R/q35_40l.log"; grep -E '"best"|^\{"1024|rc=' "$R/q35_40l.log" | cut -c1-700 | tail -n 3
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
left=$((190 - (SECONDS - START)))
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout $((left > 30 ? left : 30)) python3 -m pytest -v -s -m gpu -p no:cacheprovider \
  --rootdir="$OLDPWD" "$OLDPWD/tests/kernels/test_fp4_attention_hopper.py" "$OLDPWD/tests/rollout/test_qwen35_engine.py" \
  "$OLDPWD/tests/rollout/test_fast_decode.py") > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; grep -E "FAILED|ERROR|rc=|passed|failed" "$R/gpu_tests.log" | cut -c1-200 | tail -n 8
tar -czf "$OUT/h200_67.tar.gz" -C "$R" .
