#!/usr/bin/env bash
# Device call h100_153 (the same warm H100, the third call; main 4aa1a68): every gpu-marked test of tests/kernels, the
# first GPU run since every kernel launch pins enable_fp_fusion (0497bd8): 83 passed, bit-exact paths included.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD; cp devq/commit.txt $OUT/; timeout 225 python -m pytest -q -m gpu -p no:cacheprovider -rfE tests/kernels > $OUT/pytest_gpu_kernels.txt 2>&1; echo rc=$?; tail -5 $OUT/pytest_gpu_kernels.txt | cut -c1-300
