#!/usr/bin/env bash
# Device call h200_131 (the same warm H200; the same commit): issue 53's 128K decode cells, 40-layer Qwen3.5-35B-A3B
# shape, BF16 and FP4 engine steps, with the admission search (--admit) and records streamed to CPU memory.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
nvidia-smi --query-gpu=name --format=csv,noheader; export PYTHONUNBUFFERED=1; cp devq/commit.txt $OUT/
timeout 540 python -m benchmarks.rollout.decode_qwen35 --steps 10 --admit --hint-storage cpu --expandable-segments \
    --setups bf16_triton,fp4_triton --cells 24x131072,32x131072,128x131072,160x131072 --out $OUT/dec.json > $OUT/dec.log 2>&1
