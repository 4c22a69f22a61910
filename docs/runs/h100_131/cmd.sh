#!/usr/bin/env bash
# Device call h100_131 (the H100 of h100_129/130, warm): Qwen3.5-35B-A3B's 40-layer GRPO step, frozen FP4 + LoRA r=32
# on every target the engine folds, 256 x 1K long-tailed, micro-batch 32, packed, the recurrent rule with its backward
# kernel (chunk 16, block_v 16, one warp), the scoring forward skipped (all defaults).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
timeout 340 python -m benchmarks.training.grpo_step_qwen35 --layers 40 --freeze-experts --lora-r 32 --prompts 32 --completion 1024 \
    --eos-mean 384 --micro-batch 32 --steps 2 --setups engine_fp4 --out $OUT/q35_40_fp4.json > $OUT/all.log 2>&1
