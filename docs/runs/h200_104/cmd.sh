#!/usr/bin/env bash
# Device call h200_104 (one H200): the GPU tests of the engine, trainer and quant after the engine's LoRA folding,
# then padding-free packing (TraceGRPOConfig.token_budget) against the padded training side at 8 layers, frozen FP4
# experts + LoRA r=32, 256 long-tailed rows x 1K, and Qwen3.5's 8-layer LoRA step (engine; generate_fp4 ran out of
# the call's time). Second steps are the measurement.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/rollout tests/train tests/quant > $OUT/gpu_tests.log 2>&1
B="python -m benchmarks.training.grpo_step --layers 8 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 2 --setups engine_fp4"
timeout 160 $B --out $OUT/gs_pad.json > $OUT/gs_pad.log 2>&1
timeout 160 $B --token-budget 8192 --out $OUT/gs_packed.json > $OUT/gs_packed.log 2>&1
timeout 110 python -m benchmarks.training.grpo_step_qwen35 --layers 8 --freeze-experts --lora-r 32 --prompts 8 --completion 512 \
    --eos-mean 192 --steps 2 --setups engine_fp4,generate_fp4 --out $OUT/q35.json > $OUT/q35.log 2>&1
