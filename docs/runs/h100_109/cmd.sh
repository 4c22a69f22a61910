#!/usr/bin/env bash
# Device call h100_109 (one 80 GB H100): the GPU tests after packing became the default and after the one-pass
# hinted quantization (kernels/fp4_hinted.py), then the 8-layer Qwen3-30B-A3B-shape job (frozen FP4 + LoRA r=32,
# 256 long-tailed rows x 1K, micro-batch 32, packed) before (.before/: `git archive 42acf89 trace_hf kernels
# benchmarks`, the tree before the kernel) and after it, each with its last step's kernels profiled (--profile).
# Step 2 of 3 is the unprofiled timing. The GPU tests here hit their 260-s and 60-s limits (81 passed, no summary):
# h100_111 ran them again to the end.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
timeout 260 python -m pytest -q -m gpu tests > $OUT/gpu_tests.log 2>&1; tail -n 3 $OUT/gpu_tests.log
timeout 60 python -m pytest -q tests/kernels/test_fp4_kernels.py >> $OUT/gpu_tests.log 2>&1; tail -n 2 $OUT/gpu_tests.log
B="python -m benchmarks.training.grpo_step --layers 8 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 3 --setups engine_fp4 --micro-batch 32 --profile"
(cd .before && PYTHONPATH=/tmp/site:$PWD timeout 130 $B --out $OUT/before.json >> $L 2>&1); echo "before rc=$?"
timeout 130 $B --out $OUT/after.json >> $L 2>&1; echo "after rc=$?"
grep '^{' $L | cut -c1-400
gzip $L
