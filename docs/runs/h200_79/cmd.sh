#!/usr/bin/env bash
# Device call h200_79 (one H200), issue 31: (1) the GPU tests of the fused draw + log-prob (`gumbel_sample`) and of
# the rollout engine that now samples through it from bf16 logits; (2) decode A/B at batch 1, 256 and 512 (1K
# context, FP4): the hidden activation's quantization with fewer values per thread at decode sizes
# (`fp4_quant.CONFIG` small_call), and the quantizing RMSNorm's warps (`decode_ops.NORM_WARPS`).
#   OUT=$OUT bash docs/runs/h200_79/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 100 python3 -m pytest -v -p no:cacheprovider --rootdir="$OLDPWD" \
  "$OLDPWD/tests/kernels/test_sampling.py" && PYTHONPATH=$PKG:$PYTHONPATH timeout 200 python3 -m pytest -v -m gpu \
  -p no:cacheprovider --rootdir="$OLDPWD" "$OLDPWD/tests/rollout") > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; grep -E "FAILED|ERROR|rc=|passed|failed" "$R/gpu_tests.log" | cut -c1-200 | tail -n 8
echo "tests done at $((SECONDS - START)) s"
AB_ARGS="--setups fast_fp4 --batches 1,256,512 --contexts 1024 --budget-s 60" \
VARIANTS='{"sc8": {"fp4_quant.CONFIG": {"small_call": 8388608}},
           "sc8v8": {"fp4_quant.CONFIG": {"small_call": 8388608, "small_values_per_thread": 8}},
           "nw2": {"decode_ops.NORM_WARPS": {"fp4": 2}}, "nw8": {"decode_ops.NORM_WARPS": {"fp4": 8}},
           "pn2": {"decode_ops.NORM_WARPS": {"plain": 2, "fp4": 2}}}' \
  OUT="$R" timeout $((560 - (SECONDS - START))) python3 -m benchmarks.kernels.hopper_ab > "$R/ab.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s"; grep -E "^(base|sc8|sc8v8|nw2|nw8|pn2) [12] " "$R/ab.log" | sed 's/\[.*\]//' | cut -c1-220
tar -czf "$OUT/h200_79.tar.gz" -C "$R" .
cp "$R/gpu_tests.log" "$R/hopper_ab.json" "$OUT/" 2>/dev/null
echo "total $((SECONDS - START)) s"
