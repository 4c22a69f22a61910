#!/usr/bin/env bash
# Device call h100_106 (one 80 GB H100, commit 45c77d2, token_budget still off by default then): padding-free packing
# against TRL's padded micro-batches at 8 layers (Qwen3-30B-A3B shape, frozen FP4 + LoRA r=32, 256 x 1K) and on
# Qwen3.5's 8-layer shape. pad8 and q35pad hit their time limits in their first (kernel-compiling) step.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
B="python -m benchmarks.training.grpo_step --layers 8 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 2 --setups engine_fp4"
timeout 110 $B --out $OUT/pad8.json >> $L 2>&1
timeout 110 $B --token-budget 16384 --out $OUT/packed8.json >> $L 2>&1
timeout 110 $B --token-budget 16384 --micro-batch 32 --out $OUT/packed32.json >> $L 2>&1
timeout 110 $B --micro-batch 32 --out $OUT/pad32.json >> $L 2>&1
Q="python -m benchmarks.training.grpo_step_qwen35 --layers 8 --freeze-experts --lora-r 32 --prompts 8 --completion 512 --eos-mean 192 --steps 2 --setups engine_fp4"
timeout 65 $Q --out $OUT/q35pad.json >> $L 2>&1
timeout 65 $Q --token-budget 16384 --out $OUT/q35packed.json >> $L 2>&1
