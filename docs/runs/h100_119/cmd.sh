#!/usr/bin/env bash
# Device call h100_119 (one 80 GB H100; two calls for an H200 were refused): the fused rotary kernel (kernels/rope.py,
# bit for bit with transformers' apply_rotary_pos_emb) on the GPU, then the full 48-layer Qwen3-30B-A3B shape, frozen
# FP4 experts + LoRA r=32, 256 long-tailed rows x 1K, micro-batch 32, packed, with the fused RMSNorm and rotary
# kernels (TraceGRPOConfig's defaults; step 2 profiled, --profile train) and without (--no-fused), in one call; then
# Qwen3.5's 8-layer shape (frozen FP4 + LoRA, 32 rows x 1K) with gated_delta_rule chunk against recurrent (the
# recurrent kernel, kernels/gated_delta_recurrent.py).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
timeout 60 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_rope.py > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -n 15 $OUT/gpu_tests.log
B="python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --micro-batch 32 --setups engine_fp4 --steps 2"
timeout 170 $B --profile train --out $OUT/fp4_48_fused.json >> $L 2>&1; echo "fp4 48 fused rc=$?"
timeout 160 $B --no-fused --out $OUT/fp4_48_unfused.json >> $L 2>&1; echo "fp4 48 unfused rc=$?"
Q8="python -m benchmarks.training.grpo_step_qwen35 --layers 8 --freeze-experts --lora-r 32 --prompts 4 --completion 1024 --eos-mean 384 --steps 2 --setups engine_fp4"
timeout 60 $Q8 --gated-delta-rule chunk --out $OUT/q35_8_chunk.json >> $L 2>&1; echo "q35 8 chunk rc=$?"
timeout 60 $Q8 --gated-delta-rule recurrent --out $OUT/q35_8_recurrent.json >> $L 2>&1; echo "q35 8 recurrent rc=$?"
grep '^{"setup' $L | cut -c1-1200
gzip $L
