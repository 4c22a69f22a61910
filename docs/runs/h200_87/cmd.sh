#!/usr/bin/env bash
# Device call h200_87 (one H200), issue 31, at commit b450305 (branch int). OUT=$OUT bash gpu/call2.sh
# Device call h200_87 (issue 31): decode-step A/B at 1K of the expert kernels' options merged from the helpers'
# branches (spread decode, fused hidden quantization, batch 1's early down weights and hoisted gate/up loads) and the
# attention's spread decode; BF16 in the same run; the 16K prefill with the fp32-sum grouped GEMMs and the one-launch
# KV load now on by default; then the GPU bit-equality tests of those options in the time left.
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
SP='"*": {"spread": true}, "256": {"maxnreg": 128}, "WGMMA*": {"spread": true}, "fp4_attention.CONFIG": {"hopper": {"spread_decode": true}}'
AB_ARGS="--setups fast_fp4 --batches 1,128,256,512 --contexts 1024 --steps 10 --budget-s 60" \
VARIANTS="{\"spread\": {$SP}, \"all\": {$SP, \"8\": {\"early_weights\": 2, \"maxnreg_down\": 120}, \"1024\": {\"fused_hidden\": true}, \"WGMMA12\": {\"fused_hidden\": true}, \"WGMMA16\": {\"fused_hidden\": true}}, \"all_hoist\": {$SP, \"8\": {\"early_weights\": 2, \"maxnreg_down\": 120, \"hoist\": true}}}" \
  OUT="$R" timeout 260 python3 -m benchmarks.kernels.hopper_ab > "$R/ab.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s"; grep -E "^(base|spread|all|all_hoist) [12] " "$R/ab.log" | sed 's/\[.*\] //' | cut -c1-300
grep -E "Error|error" "$R/ab.log" | head -5
timeout 60 python3 -m benchmarks.rollout.rollout_decode --setups fast_bf16 --batches 1,128,256,512 --contexts 1024 \
  --steps 10 --out "$R/bf16_1k.json" > "$R/bf16.log" 2>&1
echo "bf16 rc=$? at $((SECONDS - START)) s"; grep -E "^setup=" "$R/bf16.log" | cut -c1-160
timeout 70 python3 -m benchmarks.rollout.prefill --setups fp4,bf16 --cells 1x16384 --budget-s 60 \
  --out "$R/prefill.json" > "$R/prefill.log" 2>&1
echo "prefill rc=$? at $((SECONDS - START)) s"; grep -E "^setup=|^ +1 x" "$R/prefill.log" | cut -c1-240
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout $((565 - (SECONDS - START))) python3 -m pytest -q -m gpu -x \
  -p no:cacheprovider --rootdir="$OLDPWD" "$OLDPWD/tests/kernels/test_fp4_moe_hopper.py" \
  "$OLDPWD/tests/kernels/test_fp4_moe_wgmma.py" \
  "$OLDPWD/tests/rollout/test_fast_decode.py::test_early_down_weights_change_no_bits_gpu") > "$R/gpu_tests.log" 2>&1
echo "tests rc=$? at $((SECONDS - START)) s"; grep -E "FAILED|ERROR|passed|failed" "$R/gpu_tests.log" | cut -c1-300 | tail -n 12
cp "$R/hopper_ab.json" "$R/bf16_1k.json" "$R/prefill.json" "$R/gpu_tests.log" "$R/ab.log" "$OUT/" 2>/dev/null
echo "total $((SECONDS - START)) s"
