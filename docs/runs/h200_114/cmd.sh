#!/usr/bin/env bash
# Device call h200_113 (one H200, commit 68974a3): the kernel tests first (the shared jit helpers of fp4_quant.py had
# not been compiled on a GPU), then FP4 against BF16 at the full 48-layer Qwen3-30B-A3B shape, frozen experts + LoRA
# r=32, 256 long-tailed rows x 1K, micro-batch 32, packed (the default), one process per setup. Step 2 is the
# measurement; step 3 is profiled (--profile train: the training side's device time by kernel and kernel class).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
timeout 170 python -m pytest -q -p no:cacheprovider tests/kernels/test_fp4_kernels.py > $OUT/kernel_tests.log 2>&1; echo "kernel tests rc=$?"; tail -2 $OUT/kernel_tests.log
B="python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 3 --micro-batch 32 --profile train"
timeout 200 $B --setups engine_fp4 --out $OUT/fp4_48.json >> $L 2>&1; echo "fp4 rc=$?"
timeout 200 $B --setups engine_bf16 --out $OUT/bf16_48.json >> $L 2>&1; echo "bf16 rc=$?"
grep '^{' $L | cut -c1-400
gzip $L
