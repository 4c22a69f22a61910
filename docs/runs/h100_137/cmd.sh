#!/usr/bin/env bash
# Device calls h100_137 (one H100, two calls on one warm machine; the tree of commit 9500155: the recurrent rule's
# backward laid out per row, and grpo_step's per-phase peaks). The only machine that started in this session, with
# about 4.5 minutes of device time left, so: (1) the gpu tests of the change and of the streamed step records;
# (2) one 40-layer Qwen3.5 step, its peak memory by phase. Step 1 rolls out the same rows as h100_136's step 1
# (same seed: 103,110 kept tokens, the same bucket trajectory), so its peak is comparable; its times are not (this
# process compiled every kernel inside the step; h100_136 ran 8-layer processes first).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
timeout 150 python -m pytest -q -m gpu tests/train/test_recurrent_rule_kernel.py tests/rollout/test_engine_streamed_records.py > $OUT/pytest_gpu.txt 2>&1
timeout 165 python -m benchmarks.training.grpo_step_qwen35 --freeze-experts --lora-r 32 --completion 1024 --eos-mean 384 \
    --micro-batch 32 --setups engine_fp4 --steps 1 --layers 40 --prompts 32 --out $OUT/q35_40.json > $OUT/all.log 2>&1
