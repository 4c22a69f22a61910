#!/usr/bin/env bash
# Device call h100_113 (one 80 GB H100, commit db79b54; no H200 could be started): the kernel tests on the GPU (the shared
# jit helpers of fp4_quant.py had not been compiled on one) and the GPU tests (-m gpu), then the full 40-layer
# Qwen3.5-35B-A3B shape, frozen FP4 experts + LoRA r=32 on every target the engine folds, 256 long-tailed rows x 1K,
# micro-batch 32, through the engine (issue 53). Step 2 is the measurement.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_fp4_kernels.py > $OUT/kernel_tests.log 2>&1; echo "kernel tests rc=$?"; tail -2 $OUT/kernel_tests.log
timeout 130 python -m pytest -q -p no:cacheprovider -m gpu tests > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log
Q40="python -m benchmarks.training.grpo_step_qwen35 --layers 40 --freeze-experts --lora-r 32 --prompts 32 --completion 1024 --eos-mean 384 --micro-batch 32 --steps 2"
timeout 290 $Q40 --setups engine_fp4 --out $OUT/q35_40_fp4.json >> $L 2>&1; echo "q35 40 fp4 rc=$?"
grep -E '^(\{|STEP)' $L | cut -c1-500
gzip $L
