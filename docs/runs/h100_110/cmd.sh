#!/usr/bin/env bash
# Device call h100_110 (one 80 GB H100, commit 51b2b16, with the one-pass hinted quantization): FP4 against
# BF16 at 24 layers of the Qwen3-30B-A3B shape (48 do not fit BF16 on an H100), frozen experts + LoRA r=32, 256
# long-tailed rows x 1K, micro-batch 32, packed (the default). One process per setup; step 2 is the measurement.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
B="python -m benchmarks.training.grpo_step --layers 24 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 2 --micro-batch 32"
timeout 270 $B --setups engine_fp4 --out $OUT/fp4_24.json >> $L 2>&1; echo "fp4 rc=$?"
timeout 270 $B --setups engine_bf16 --out $OUT/bf16_24.json >> $L 2>&1; echo "bf16 rc=$?"
grep '^{' $L | cut -c1-600
gzip $L
