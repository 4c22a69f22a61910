#!/usr/bin/env bash
# Device call h100_129 (H100 or H200, gpu.txt names it): (1) the gpu tests of the packed training forwards (the fp32
# packed attention on CUDA, row by row, among them), the Qwen3.5 engine, the engine's waves and admission, and
# compaction through the finer buckets (8 to 64 rows in steps of 8); (2) Qwen3.5's 40-layer FP4 decode at 128K with
# the rows the engine now admits (--admit; 32 rows beside it, as in h100_127).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
timeout 130 python -m pytest -q -m gpu tests/train/test_packed_forwards.py tests/rollout/test_qwen35_engine.py \
    tests/rollout/test_engine_waves.py tests/rollout/test_engine_compaction.py -p no:cacheprovider > $OUT/pytest.txt 2>&1; echo "pytest rc=$?"
grep -E 'passed|failed|error' $OUT/pytest.txt | tail -5
timeout 200 python -m benchmarks.rollout.decode_qwen35 --setups fp4_triton --steps 10 --admit --cells 32x131072 \
    --out $OUT/decode_128k.json >> $L 2>&1; echo "decode rc=$?"; grep '^{' $L | cut -c1-300
gzip $L
