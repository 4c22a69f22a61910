#!/usr/bin/env bash
# Device call h100_122 (one 80 GB H100, commit de2ab95, right after h100_121 on the same machine): the GPU tests of
# the trainer paths the last commits changed (PEFT's input casts, the frozen experts' kept hidden, the recompute's
# counting), then the full 40-layer Qwen3.5-35B-A3B shape, frozen FP4 experts + LoRA r=32 on every target the engine
# folds, 256 long-tailed rows x 1K, micro-batch 32, with the defaults (packed; gated_delta_rule "auto", i.e. the
# recurrent values), issue 53's step and peak memory. Step 2 is the measurement.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/train/test_adapter_casts.py tests/quant/test_frozen_kernel_training.py tests/hints/test_hints.py > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -n 15 $OUT/gpu_tests.log
Q40="python -m benchmarks.training.grpo_step_qwen35 --layers 40 --freeze-experts --lora-r 32 --prompts 32 --completion 1024 --eos-mean 384 --micro-batch 32 --steps 2 --setups engine_fp4"
timeout 400 $Q40 --out $OUT/q35_40_fp4.json >> $L 2>&1; echo "q35 40 fp4 rc=$?"
grep '^STEP' $L | cut -c1-600
gzip $L
