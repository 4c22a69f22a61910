#!/usr/bin/env bash
# Device call h100_135 (one H100; the code of 2519057): the gpu tests of tests/train, tests/quant and tests/hints.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
timeout 100 python -m pytest -q -m gpu tests/train tests/quant tests/hints -p no:cacheprovider > $OUT/pytest_gpu.txt 2>&1
