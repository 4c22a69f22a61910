#!/usr/bin/env bash
# Device call h100_134 (the same warm H100): the 8-layer full fine-tune (QAT) step, 256 x 512 long-tailed, micro-batch
# 32: packed (the default) against TRL's padded micro-batches (--token-budget 0).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
Q="python -m benchmarks.training.grpo_step --layers 8 --prompts 32 --completion 512 --eos-mean 192 --micro-batch 32 --steps 2 --setups engine_fp4"
timeout 75 $Q --out $OUT/qat8_packed.json > $OUT/all.log 2>&1
timeout 70 $Q --token-budget 0 --out $OUT/qat8_padded.json >> $OUT/all.log 2>&1
