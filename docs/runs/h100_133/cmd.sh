#!/usr/bin/env bash
# Device call h100_133 (the same warm H100): the 48-layer job with --recompute-experts again, after h100_129's
# recompute / kept pair (the reverse order's third process).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
timeout 150 python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 \
    --prompts 32 --steps 2 --micro-batch 32 --setups engine_fp4 --recompute-experts --out $OUT/fp4_48_recompute_again.json > $OUT/all.log 2>&1
