#!/usr/bin/env bash
# Device call h100_136 (one H100; asked as nvidia-h200 without needs_h200, an H100 came), commit 401ba34: devq/any.sh -> main.sh below.
# The warm-up process failed (2 prompts x 8 < micro-batch 32: no micro-batch); so the 'skip' process compiled in its
# step and ran past its 80-s timeout (no JSON); its STEP line is in all.log.gz.
# (1) the gpu tests of this session's changes; (2) Qwen3.5 8 layers, 256 long-tailed rows x 1K, frozen FP4 experts
# + LoRA r=32, micro-batch 32: a warm-up process, then one step each from the same seed (the same rollout) with the
# recurrent rule skipping packed rows' padding (the default) and stepping it (--rule-over-padding), both profiled
# (--profile train); (3) the 40-layer step with the defaults (h100_131: 71.7 s).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
timeout 120 python -m pytest -q -m gpu tests/train/test_recurrent_rule_kernel.py tests/rollout/test_engine_streamed_records.py > $OUT/pytest_gpu.txt 2>&1; echo "pytest rc=$?"; tail -2 $OUT/pytest_gpu.txt
Q="--freeze-experts --lora-r 32 --completion 1024 --eos-mean 384 --micro-batch 32 --setups engine_fp4"
timeout 60 python -m benchmarks.training.grpo_step_qwen35 $Q --layers 8 --prompts 2 --steps 1 --out $OUT/warmup.json >> $L 2>&1; echo "warmup rc=$?"
timeout 80 python -m benchmarks.training.grpo_step_qwen35 $Q --layers 8 --prompts 32 --steps 1 --profile train --out $OUT/q35_8_skip.json >> $L 2>&1; echo "skip rc=$?"
timeout 80 python -m benchmarks.training.grpo_step_qwen35 $Q --layers 8 --prompts 32 --steps 1 --profile train --rule-over-padding --out $OUT/q35_8_pad.json >> $L 2>&1; echo "pad rc=$?"
grep '^STEP' $L | cut -c1-300
timeout 200 python -m benchmarks.training.grpo_step_qwen35 $Q --layers 40 --prompts 32 --steps 2 --out $OUT/q35_40.json >> $L 2>&1; echo "q35_40 rc=$?"
grep '^STEP' $L | tail -2 | cut -c1-300
gzip $L
