#!/usr/bin/env bash
# NOT RUN in the session that wrote it: no device time was left to start a machine.
# Device call h100_129 (H100 or H200, gpu.txt names it): the gpu tests of the packed training forwards (the fp32 packed attention
# on CUDA, row by row, among them), the Qwen3.5 engine, the engine's waves and admission, and compaction through the finer buckets (8 to 64 rows in steps of 8).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
timeout 110 python -m pytest -q -m gpu tests/train/test_packed_forwards.py tests/rollout/test_qwen35_engine.py \
    tests/rollout/test_engine_waves.py tests/rollout/test_engine_compaction.py -p no:cacheprovider > $OUT/pytest.txt 2>&1; echo "pytest rc=$?"
grep -E 'passed|failed|error' $OUT/pytest.txt | tail -5
