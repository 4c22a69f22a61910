#!/usr/bin/env bash
# Device call h200_132 (the same warm H200; the same commit): h200_129's failing tests, one file at a time, stopping at
# the first failure. No files came back; out.txt is the reply's output.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
timeout 100 python -m pytest -q -x -p no:cacheprovider --tb=short tests/kernels/test_token_counts.py 2>&1 | tail -40
timeout 120 python -m pytest -q -p no:cacheprovider --tb=line -x tests/kernels/test_rms_norm.py 2>&1 | tail -15
