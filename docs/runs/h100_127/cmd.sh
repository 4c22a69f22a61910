#!/usr/bin/env bash
# Device call h100_127 (one 80 GB H100): Qwen3.5-35B-A3B's 40-layer decode step at 128K context, BF16 against FP4 (Triton
# delta rule), a batch sweep for each setup's best batch, and with --admit the rows the rollout engine admits at that
# context (FP4 with the step records it keeps per decoded token held beside the cache). 
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
timeout 400 python -m benchmarks.rollout.decode_qwen35 --setups bf16_triton,fp4_triton --steps 10 --admit \
    --cells 2x131072,4x131072,8x131072,16x131072,32x131072,48x131072,64x131072 --out $OUT/decode_128k.json >> $L 2>&1
echo "decode rc=$?"; grep '^{' $L | cut -c1-300
gzip $L
