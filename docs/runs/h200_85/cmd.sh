#!/usr/bin/env bash
# Device call h200_85 (one H200), issue 31, at commit 202b249: the hidden activation's quantization skipping the
# experts' padding rows (`fp4_quant.quantize(..., live_rows=)`, reverted after this run: 3% of that kernel, docs/
# benchmarks.md): (1) the GPU tests of the expert kernels (Gluon, wgmma, Triton) and the
# quantization kernels; (2) decode at batch 256 and 512, 1K context, both precisions.
#   OUT=$OUT bash docs/runs/h200_85/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider \
  --rootdir="$OLDPWD" "$OLDPWD/tests/kernels/test_fp4_moe_hopper.py" "$OLDPWD/tests/kernels/test_fp4_moe_wgmma.py" \
  "$OLDPWD/tests/kernels/test_fp4_moe.py" "$OLDPWD/tests/kernels/test_fp4_kernels.py") > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; grep -E "FAILED|ERROR|rc=|passed|failed" "$R/gpu_tests.log" | cut -c1-200 | tail -n 8
echo "tests done at $((SECONDS - START)) s"
timeout $((235 - (SECONDS - START))) python3 -m benchmarks.rollout.rollout_decode --setups fast_bf16,fast_fp4 \
  --batches 256,512 --contexts 1024 --profile --steps 20 --budget-s 60 --out "$R/decode_1k.json" > "$R/decode_1k.log" 2>&1
echo "decode rc=$? at $((SECONDS - START)) s"; grep -E "^setup=" "$R/decode_1k.log" | cut -c1-120
cp "$R/gpu_tests.log" "$R/decode_1k.json" "$OUT/" 2>/dev/null
echo "total $((SECONDS - START)) s"
