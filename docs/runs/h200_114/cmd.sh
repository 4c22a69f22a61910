#!/usr/bin/env bash
# NOT RUN in the session that wrote it: no H200 could be started (three refusals). The next session runs it as is
# (needs_h200: BF16 at 48 layers takes ~94 GiB).
# Device call h200_114 (one H200, commit 68974a3): FP4 against BF16 at the full 48-layer Qwen3-30B-A3B shape, frozen experts + LoRA
# r=32, 256 long-tailed rows x 1K, micro-batch 32, packed (the default), one process per setup. Step 2 is the
# measurement; step 3 is profiled (--profile train: the training side's device time by kernel and kernel class). Then
# Qwen3.5's 8-layer shape (frozen FP4 + LoRA, 64 rows x 512) with TRL's padded micro-batches against packed.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
B="python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 3 --micro-batch 32 --profile train"
timeout 200 $B --setups engine_fp4 --out $OUT/fp4_48.json >> $L 2>&1; echo "fp4 rc=$?"
timeout 200 $B --setups engine_bf16 --out $OUT/bf16_48.json >> $L 2>&1; echo "bf16 rc=$?"
Q8="python -m benchmarks.training.grpo_step_qwen35 --layers 8 --freeze-experts --lora-r 32 --prompts 8 --completion 512 --eos-mean 192 --steps 3 --setups engine_fp4"
timeout 70 $Q8 --token-budget 0 --out $OUT/q35_8_padded.json >> $L 2>&1; echo "q35 8 padded rc=$?"
timeout 70 $Q8 --token-budget 16384 --out $OUT/q35_8_packed.json >> $L 2>&1; echo "q35 8 packed rc=$?"
grep '^{' $L | cut -c1-400
gzip $L
