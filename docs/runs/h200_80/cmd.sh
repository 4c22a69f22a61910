#!/usr/bin/env bash
# Device call h200_80 (one H200, warm after h200_79), issue 31, with the fused sampler and h200_79's settings
# committed: (1) the 8-layer long-tailed GRPO step with `--profile rollout` in both precisions; (2) the 48-layer
# decode table at 1K context, both precisions, batch 1-512.
#   OUT=$OUT bash docs/runs/h200_80/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
timeout 300 python3 -m benchmarks.training.grpo_step --prompts 32 --completion 512 --eos-mean 192 \
  --setups engine_bf16,engine_fp4 --steps 3 --profile rollout --out "$R/grpo_rollout_profile.json" \
  > "$R/grpo_rollout_profile.log" 2>&1
echo "grpo rc=$? at $((SECONDS - START)) s"; tail -n 5 "$R/grpo_rollout_profile.log" | cut -c1-300
timeout $((570 - (SECONDS - START))) python3 -m benchmarks.rollout.rollout_decode --setups fast_bf16,fast_fp4 \
  --batches 1,64,128,256,512 --contexts 1024 --steps 20 --budget-s $((520 - (SECONDS - START))) \
  --out "$R/decode_1k.json" > "$R/decode_1k.log" 2>&1
echo "decode rc=$? at $((SECONDS - START)) s"; grep -E "^setup=" "$R/decode_1k.log" | cut -c1-160
tar -czf "$OUT/h200_80.tar.gz" -C "$R" .
cp "$R/grpo_rollout_profile.json" "$R/decode_1k.json" "$OUT/" 2>/dev/null
echo "total $((SECONDS - START)) s"
