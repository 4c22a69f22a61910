#!/usr/bin/env bash
# Device call h100_129 (one 80 GB H100): the 48-layer job of h100_126 with the scoring forward skipped (the default),
# step 2 profiled (--profile train): the training side's device time by kernel class, and how busy the GPU is.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
B="python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 2 --micro-batch 32 --setups engine_fp4"
timeout 250 $B --profile train --out $OUT/fp4_48_profile.json >> $L 2>&1; echo "fp4 profile rc=$?"
grep '^STEP' $L | cut -c1-330
gzip $L
