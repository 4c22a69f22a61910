#!/usr/bin/env bash
# Device call h100_118 (one 80 GB H100): the fused RMSNorm kernels (kernels/rms_norm.py) and the recurrent Gated
# DeltaNet kernel against torch on the GPU, then the full 48-layer Qwen3-30B-A3B shape, frozen FP4 experts + LoRA
# r=32, 256 long-tailed rows x 1K, micro-batch 32, packed: with the fused norms (TraceGRPOConfig's default; step 3
# profiled, --profile train) and without (--no-fused-rms-norm, steps 1-2), in one call.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_rms_norm.py tests/train/test_recurrent_rule_kernel.py > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -n 15 $OUT/gpu_tests.log
B="python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --micro-batch 32 --setups engine_fp4"
timeout 215 $B --steps 3 --profile train --out $OUT/fp4_48_fused.json >> $L 2>&1; echo "fp4 48 fused rc=$?"
timeout 165 $B --steps 2 --no-fused-rms-norm --out $OUT/fp4_48_unfused.json >> $L 2>&1; echo "fp4 48 unfused rc=$?"
grep '^{"setup' $L | cut -c1-1200
gzip $L
