#!/usr/bin/env bash
# Device call h200_127 (one H200): Qwen3.5-35B-A3B's 40-layer decode step at 128K context, BF16 against FP4 (Triton
# delta rule), a batch sweep for each setup's best batch, and with --admit the rows the rollout engine admits at that
# context (FP4 with the step records it keeps per decoded token held beside the cache). First the gpu tests of the
# packed training forwards (skip_scoring_forward in bf16 on CUDA, varlen flash attention).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
timeout 120 python -m pytest -q -m gpu tests/train/test_packed_forwards.py -p no:cacheprovider > $OUT/pytest.txt 2>&1; echo "pytest rc=$?"; tail -3 $OUT/pytest.txt
timeout 420 python -m benchmarks.rollout.decode_qwen35 --setups bf16_triton,fp4_triton --steps 10 --admit \
    --cells 16x131072,24x131072,32x131072,64x131072,96x131072,128x131072,144x131072 --out $OUT/decode_128k.json >> $L 2>&1
echo "decode rc=$?"; grep '^{' $L | cut -c1-300
gzip $L
