#!/usr/bin/env bash
# Device call h100_107 (one 80 GB H100, commit 3bfb509: token_budget=None packs Qwen3 MoE by default): the full
# 48-layer Qwen3-30B-A3B job, frozen FP4 experts + LoRA r=32, 256 long-tailed rows x 1K, micro-batches of 32 rows,
# TRL's padded micro-batches (--token-budget 0) against the default packed forwards. Second steps are the measurement.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
B="python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 2 --setups engine_fp4 --micro-batch 32"
timeout 235 $B --token-budget 0 --out $OUT/pad48.json >> $L 2>&1
timeout 235 $B --out $OUT/packed48.json >> $L 2>&1
