#!/usr/bin/env bash
# Device call h200_59 (one H200): issue 30's 64 x 8K GRPO step of the full 48-layer Qwen3-30B-A3B shape, FP4 + TRACE
# with frozen FP4 experts, two steps in a call of its own (h200_57/58 ran both setups in one call and ran out of
# time in each second step). From the root:
#   OUT=$OUT bash docs/runs/h200_59/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
C="--layers 48 --freeze-experts --lora-r 32 --prompts 8 --completion 8192 --eos-mean 3072 --micro-batch 1 --steps 2"
S=engine_fp4
timeout "${FP4_S:-560}" python3 -m benchmarks.training.grpo_step $C --setups $S --out "$R/grpo_30b_64x8k_$S.json" \
  > "$R/grpo_30b_64x8k_$S.log" 2>&1
echo "rc=$? after $((SECONDS - START)) s" >> "$R/grpo_30b_64x8k_$S.log"
grep -E '^STEP|rc=|Error' "$R/grpo_30b_64x8k_$S.log" | cut -c1-1500 | tail -n 4
tar -czf "$OUT/h200_59.tar.gz" -C "$R" .
