#!/usr/bin/env bash
# Device call h100_147 (the same H100, warm; commit 166e57e): FP4 + TRACE at 24 layers with --profile-host (the kernels
# counted once; gpu_busy per phase). The profiled step's phase times include the profiler's own cost: read the
# profile, not its step time.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1; L=$OUT/all.log
timeout 150 python -m benchmarks.training.grpo_step --layers 24 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 2 --micro-batch 32 --setups engine_fp4 --profile-host --out $OUT/fp4_24_host.json >> $L 2>&1; echo "rc=$?"; grep '^STEP' $L | cut -c1-200; gzip $L
