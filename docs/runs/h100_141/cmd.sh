#!/usr/bin/env bash
# Device call h100_141 (one H100, a fresh machine; commit daca750): the 48-layer job at micro-batch 32, the
# default allocator and then expandable segments, each process's step 2; grpo_step now logs allocator retries.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
B="python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 2 --setups engine_fp4 --micro-batch 32"
timeout 135 $B --out $OUT/q3_48_mb32.json >> $L 2>&1
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 105 $B --out $OUT/q3_48_mb32_expandable.json >> $L 2>&1
gzip $L
