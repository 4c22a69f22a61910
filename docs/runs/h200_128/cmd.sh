#!/usr/bin/env bash
# NOT RUN in the session that wrote it: the H200 was refused (the budget left could not hold a start and both runs).
# Device call h200_128 (one H200, needs_h200: BF16 at 48 layers takes ~94 GiB): FP4 against BF16 at the full 48-layer Qwen3-30B-A3B shape, frozen experts + LoRA r=32, 256 long-tailed rows x
# 1K, micro-batch 32, packed, the scoring forward skipped (the defaults), unprofiled; step 2 is the measurement.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
B="python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 2 --micro-batch 32"
timeout 125 $B --setups engine_fp4 --out $OUT/fp4_48.json >> $L 2>&1; echo "fp4 rc=$?"
timeout 190 $B --setups engine_bf16 --out $OUT/bf16_48.json >> $L 2>&1; echo "bf16 rc=$?"
grep '^STEP' $L | cut -c1-330
gzip $L
