#!/usr/bin/env bash
# Device call h100_132 (the same warm H100): Qwen3.5's 40-layer FP4 decode at 128K, 32 rows and the rows the engine
# admits (--admit) with the finer buckets.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
timeout 200 python -m benchmarks.rollout.decode_qwen35 --setups fp4_triton --steps 10 --admit --cells 32x131072 \
    --out $OUT/decode_128k.json > $OUT/all.log 2>&1
