#!/usr/bin/env bash
# Device call h200_91 (one H200), issue 31, at commit 559c4c4: the decode step's GPU tests after their graph-replay loop
# became one helper (12 passed).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD; PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"; T=$PWD/tests; cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir="$OLDPWD" "$T/rollout/test_fast_decode.py" 2>&1 | tee $OUT/gpu_tests.log | tail -5
