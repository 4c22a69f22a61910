#!/usr/bin/env bash
# Device call h200_128 (one H200, needs_h200: BF16 at 48 layers takes ~94 GiB). (1) Qwen3.5-35B-A3B's 40-layer decode
# at 128K context, BF16 against FP4 (Triton delta rule), batch sweep and the engine's admitted cell (--admit).
# (2) FP4 against BF16 at the full 48-layer Qwen3-30B-A3B shape, frozen experts + LoRA r=32, 256 long-tailed rows x
# 1K, micro-batch 32, packed, the scoring forward skipped (the defaults), unprofiled; step 2 is the measurement.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
timeout 100 python -m benchmarks.rollout.decode_qwen35 --setups bf16_triton,fp4_triton --steps 10 --admit \
    --cells 16x131072,24x131072,32x131072,64x131072,96x131072,128x131072,144x131072 --out $OUT/decode_128k.json >> $L 2>&1
echo "decode rc=$?"
B="python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 2 --micro-batch 32"
timeout 130 $B --setups engine_fp4 --out $OUT/fp4_48.json >> $L 2>&1; echo "fp4 rc=$?"
timeout 200 $B --setups engine_bf16 --out $OUT/bf16_48.json >> $L 2>&1; echo "bf16 rc=$?"
grep '^STEP' $L | cut -c1-330; grep '"best"\|^{"131072"' $L | cut -c1-600
gzip $L
