#!/usr/bin/env bash
# Run as: OUT=$OUT bash docs/runs/h200_99/cmd.sh, at commit 0a8d610 (the session's final code).
# Device call h200_99 (issue 31): every GPU-marked test (pytest -m gpu, 90 tests) at the final code, with the
# attention's new split settings and session 23's engine and kernel changes.
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
T=$PWD/tests
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 \
  --rootdir="$OLDPWD" "$T") > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? at $((SECONDS - START)) s"; grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tests.log" | tail -12
echo "total $((SECONDS - START)) s"
