#!/usr/bin/env bash
# Device call h200_61 (one H200): issue 30's `generate` BF16 setup at 256 x 1K (full 48-layer Qwen3-30B-A3B shape,
# frozen BF16 experts + LoRA), then issue 32's 8-layer Qwen3.5 GRPO step again now that the engine's delta rule is
# the Triton one on CUDA, each in its own process. From the root:
#   OUT=$OUT bash docs/runs/h200_61/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
C="--layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 2"
S=generate_bf16
timeout "${GEN_S:-330}" python3 -m benchmarks.training.grpo_step $C --setups $S --out "$R/grpo_30b_256x1k_$S.json" \
  > "$R/grpo_30b_256x1k_$S.log" 2>&1
echo "rc=$? after $((SECONDS - START)) s" >> "$R/grpo_30b_256x1k_$S.log"
grep -E '^STEP|rc=|Error' "$R/grpo_30b_256x1k_$S.log" | cut -c1-1200 | tail -n 4
left=$((570 - (SECONDS - START)))
timeout $((left > 30 ? left : 30)) python3 -m benchmarks.training.grpo_step_qwen35 \
  --setups engine_fp4,engine_bf16,generate_bf16 --steps 2 --out "$R/grpo_step_qwen35.json" > "$R/grpo_step_qwen35.log" 2>&1
echo "rc=$? after $((SECONDS - START)) s" >> "$R/grpo_step_qwen35.log"
grep -E '^STEP|^\{"setup"|rc=|Error' "$R/grpo_step_qwen35.log" | cut -c1-700 | tail -n 8
tar -czf "$OUT/h200_61.tar.gz" -C "$R" .
