#!/usr/bin/env bash
# Device calls h100_111 (one 80 GB H100, warm after h100_110; tree 51b2b16 + the use of kernels/fp4_hinted.py, as
# committed after): the GPU tests after packing became the default and after the one-pass hinted quantization. The
# first call's kernel-file run hit its 100-s limit while compiling (27 tests done); the second ran the file again.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
timeout 390 python -m pytest -q -p no:cacheprovider -m gpu tests > $OUT/gpu_tests.log 2>&1    # 87 passed, 2 skipped, 71 s
timeout 270 python -m pytest -q -p no:cacheprovider --durations=8 tests/kernels/test_fp4_kernels.py > $OUT/kernel_tests.log 2>&1    # 40 passed (cuda)
