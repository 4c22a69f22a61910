#!/usr/bin/env bash
# Device call h100_149 (the same H100 as h100_148, warm; commit bf54b35): the full 48-layer FP4 job, steps 1-3 of one
# process, per-call timing of the last step and Triton specialization misses (benchmarks/stall_log.py, as in h100_148).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
timeout 280 python -m benchmarks.stall_log benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 3 --micro-batch 32 --setups engine_fp4 --out $OUT/fp4_48.json > $OUT/fp4_48.log 2>&1
gzip $OUT/fp4_48.log
