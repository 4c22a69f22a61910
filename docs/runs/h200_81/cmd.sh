#!/usr/bin/env bash
# Device call h200_81 (one H200), issue 31, the draw with one Philox evaluation per four tokens and a fast outer log:
# (1) GPU tests of the sampler and the engine; (2) the 8-layer long-tailed GRPO step with `--profile rollout`, both
# precisions; (3) per-kernel profiles of the decode step at batch 128 and 256 (1K context, both precisions: the
# missed 1.6x goals); (4) decode at 8K context, each precision at the batches where its best was (h200_69).
#   OUT=$OUT bash docs/runs/h200_81/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 100 python3 -m pytest -v -p no:cacheprovider --rootdir="$OLDPWD" \
  "$OLDPWD/tests/kernels/test_sampling.py" && PYTHONPATH=$PKG:$PYTHONPATH timeout 150 python3 -m pytest -v -m gpu \
  -p no:cacheprovider --rootdir="$OLDPWD" "$OLDPWD/tests/rollout") > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; grep -E "FAILED|ERROR|rc=|passed|failed" "$R/gpu_tests.log" | cut -c1-200 | tail -n 8
echo "tests done at $((SECONDS - START)) s"
timeout 200 python3 -m benchmarks.training.grpo_step --prompts 32 --completion 512 --eos-mean 192 \
  --setups engine_bf16,engine_fp4 --steps 3 --profile rollout --out "$R/grpo_rollout_profile.json" \
  > "$R/grpo_rollout_profile.log" 2>&1
echo "grpo rc=$? at $((SECONDS - START)) s"; tail -n 2 "$R/grpo_rollout_profile.log" | cut -c1-300
timeout 100 python3 -m benchmarks.rollout.rollout_decode --setups fast_bf16,fast_fp4 --batches 128,256 --contexts 1024 \
  --profile --steps 10 --budget-s 80 --out "$R/decode_profile.json" > "$R/decode_profile.log" 2>&1
echo "decode profile rc=$? at $((SECONDS - START)) s"; grep -E "^setup=" "$R/decode_profile.log" | cut -c1-120
timeout $((575 - (SECONDS - START))) python3 -m benchmarks.rollout.rollout_decode --setups fast_bf16,fast_fp4 \
  --batches 96,256,384 --contexts 8192 --budget-s $((540 - (SECONDS - START))) --out "$R/decode_8k.json" \
  > "$R/decode_8k.log" 2>&1
echo "decode 8k rc=$? at $((SECONDS - START)) s"; grep -E "^setup=" "$R/decode_8k.log" | cut -c1-120
tar -czf "$OUT/h200_81.tar.gz" -C "$R" .
cp "$R/gpu_tests.log" "$R/grpo_rollout_profile.json" "$R/decode_profile.json" "$R/decode_8k.json" "$OUT/" 2>/dev/null
echo "total $((SECONDS - START)) s"
