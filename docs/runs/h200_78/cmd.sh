#!/usr/bin/env bash
# Device call h200_78 (one H200), issue 31: (1) the GPU tests of the wgmma expert kernels with the committed WGMMA
# table (its register caps were GPU-tested as variants in h200_77); (2) per-kernel profiles of the decode step at
# batch 1 and 512 (1K context, both precisions: what the two missed 1K goals spend their time on); (3) the 8-layer
# long-tailed GRPO step with `--profile rollout`: the last step's rollout kernel by kernel in each precision.
#   OUT=$OUT bash docs/runs/h200_78/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 120 python3 -m pytest -v -m gpu -p no:cacheprovider \
  --rootdir="$OLDPWD" "$OLDPWD/tests/kernels/test_fp4_moe_wgmma.py") > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; grep -E "FAILED|ERROR|rc=|passed|failed" "$R/gpu_tests.log" | cut -c1-200 | tail -n 6
echo "tests done at $((SECONDS - START)) s"
timeout 110 python3 -m benchmarks.rollout.rollout_decode --setups fast_bf16,fast_fp4 --batches 1,512 --contexts 1024 \
  --profile --steps 10 --budget-s 90 --out "$R/decode_profile.json" > "$R/decode_profile.log" 2>&1
echo "decode rc=$? at $((SECONDS - START)) s"; grep -E "^setup=" "$R/decode_profile.log" | cut -c1-160
timeout 270 python3 -m benchmarks.training.grpo_step --prompts 32 --completion 512 --eos-mean 192 \
  --setups engine_bf16,engine_fp4 --steps 3 --profile rollout --out "$R/grpo_rollout_profile.json" \
  > "$R/grpo_rollout_profile.log" 2>&1
echo "grpo rc=$? at $((SECONDS - START)) s"; tail -n 5 "$R/grpo_rollout_profile.log" | cut -c1-300
tar -czf "$OUT/h200_78.tar.gz" -C "$R" .
cp "$R/gpu_tests.log" "$R/decode_profile.json" "$R/grpo_rollout_profile.json" "$OUT/" 2>/dev/null
echo "total $((SECONDS - START)) s"
