#!/usr/bin/env bash
# Device call h100_139 (one H100; asked as nvidia-h200 without needs_h200), commit e3e7a68: admission leaves out the allocator's
# fragments; 128K decode with the default allocator and with expandable segments, in one call. (A call between h100_138 and
# this one tried an empty_cache before the graph capture, which changed nothing: 56 rows still failed; reverted, not kept.)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
timeout 100 python -m pytest -q -m gpu -p no:cacheprovider tests/rollout/test_engine_waves.py > $OUT/pytest_gpu.txt 2>&1
D="python -m benchmarks.rollout.decode_qwen35 --steps 10 --admit --hint-storage cpu --setups fp4_triton --cells 48x131072,56x131072,64x131072,72x131072"
timeout 120 $D --out $OUT/dec_default.json
timeout 120 $D --expandable-segments --out $OUT/dec_expandable.json
timeout 300 python -m benchmarks.rollout.decode_qwen35 --steps 10 --admit --expandable-segments --setups bf16_triton --cells 4x131072,6x131072,8x131072 --out $OUT/dec_bf16_expandable.json
