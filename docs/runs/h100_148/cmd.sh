#!/usr/bin/env bash
# Device call h100_148 (one H100, a fresh machine; commit bf54b35): FP4 against BF16 at 24 layers of the 256 x 1K job,
# one process each, steps 2-3 the measurement, each call of the last step timed (phase_calls_last_step) and every
# Triton specialization miss printed by benchmarks/stall_log.py (run then as devq/jit_count.py, before it was committed).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
B="python -m benchmarks.stall_log benchmarks.training.grpo_step --layers 24 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 3 --micro-batch 32"
timeout 200 $B --setups engine_fp4 --out $OUT/fp4_24.json > $OUT/fp4.log 2>&1
timeout 230 $B --setups engine_bf16 --out $OUT/bf16_24.json > $OUT/bf16.log 2>&1
gzip $OUT/fp4.log $OUT/bf16.log
