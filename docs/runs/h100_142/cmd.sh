#!/usr/bin/env bash
# Device call h100_142 (one H100, a fresh machine; commit 8c197d8): the 48-layer job at micro-batch 32 with
# --profile-host (timed out: its first step compiled every kernel), then 64 x 8K FP4, packed, micro-batch 8.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; L=$OUT/all.log
B="python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --setups engine_fp4 --steps 2"
timeout 150 $B --eos-mean 384 --completion 1024 --prompts 32 --micro-batch 32 --profile-host --out $OUT/fp4_48_host.json >> $L 2>&1
timeout 395 $B --prompts 8 --completion 8192 --eos-mean 3072 --micro-batch 8 --out $OUT/fp4_48_64x8k.json >> $L 2>&1
gzip $L
