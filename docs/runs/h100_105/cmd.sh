#!/usr/bin/env bash
# Device call h100_105 (one 80 GB H100, commit d28ab18 + the working tree): the GPU tests after the moves of issue 56
# (87 passed, 2 skipped), then the 8-layer grpo_step padded and packed; the packed runs failed there (the varlen
# attention's rows were a context variable that autograd's device threads did not see; fixed in 45c77d2), so only
# the padded result is kept (gs_pad_mb8.json).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests > $OUT/gpu_tests.log 2>&1
B="python -m benchmarks.training.grpo_step --layers 8 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 2 --setups engine_fp4"
timeout 100 $B --out $OUT/gs_pad.json > $OUT/gs_pad.log 2>&1
