#!/usr/bin/env bash
# Device call h100_143 (the same H100, still warm; commit 8c197d8): the 48-layer job at micro-batch 32 with
# --profile-host. Its device_ms counted each kernel twice (the op's self device time and the kernel's own; fixed in
# the next commit), so only wall times, syncs, launches, aten ops and "Command Buffer Full" are read from it.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1; L=$OUT/all.log
timeout 230 python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --setups engine_fp4 --steps 2 --eos-mean 384 --completion 1024 --prompts 32 --micro-batch 32 --profile-host --out $OUT/fp4_48_host.json >> $L 2>&1
gzip $L
