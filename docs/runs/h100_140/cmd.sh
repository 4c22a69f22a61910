#!/usr/bin/env bash
# Device calls h100_140 (one H100, two calls on one warm machine, commit 07790ca): the full 48-layer Qwen3-30B-A3B
# job, frozen FP4 experts + LoRA r=32, 256 long-tailed rows x 1K, packed, unprofiled; step 2 is the measurement.
# Call 1 ran three processes in this order; the first (micro-batch 32, default allocator) compiled every kernel in
# its step 1 (72.8 s) and ran past its 120-s timeout, so call 2 ran it again on the same machine.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
B="python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 2 --setups engine_fp4"
# call 1
timeout 120 $B --micro-batch 32 --out $OUT/q3_48_mb32.json                  # timed out (compile)
timeout 120 $B --micro-batch 64 --out $OUT/q3_48_mb64.json
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 120 $B --micro-batch 32 --out $OUT/q3_48_mb32_expandable.json
# call 2
timeout 110 $B --micro-batch 32 --out $OUT/q3_48_mb32.json
