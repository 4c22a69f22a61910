#!/usr/bin/env bash
# Device call h200_63 (one H200), the session's last ~190 s: where the training side's cost per micro-batch goes at
# full depth (48-layer Qwen3-30B-A3B shape, frozen experts + LoRA r=32, one row per micro-batch as at 64 x 8K):
# `grpo_step --profile` over the second step, now with the host's syncs, launches and costliest ops and each
# phase's device time, FP4 then BF16, each in its own process. From the root:
#   OUT=$OUT bash docs/runs/h200_63/cmd.sh
# (It ran at commit 975828b. Since 8506a09 the host-side profile is `--profile-host`, one call per phase: see notes 6c.)
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
C="--layers 48 --freeze-experts --lora-r 32 --prompts 1 --completion 256 --eos-mean 64 --micro-batch 1 --steps 2 --profile"
for S in engine_fp4 engine_bf16; do
  left=$((${END_S:-185} - (SECONDS - START)))
  timeout $((left > 20 ? left : 20)) python3 -m benchmarks.training.grpo_step $C --setups $S \
    --out "$OUT/profile_$S.json" > "$OUT/profile_$S.log" 2>&1
  echo "rc=$? after $((SECONDS - START)) s" >> "$OUT/profile_$S.log"; grep -E "^STEP|rc=" "$OUT/profile_$S.log" | cut -c1-600
done
