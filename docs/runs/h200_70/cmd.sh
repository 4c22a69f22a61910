#!/usr/bin/env bash
# Device call h200_70 (one H200), issue 31: the GPU tests of the experts kernels after the grouped path's test moved
# to 6,144 tokens (h200_69 ran it at 2,048, under `GROUPED["from"]`). From the root:
#   OUT=$OUT bash docs/runs/h200_70/cmd.sh
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 150 python3 -m pytest -v -s -m gpu -p no:cacheprovider \
  --rootdir="$OLDPWD" "$OLDPWD/tests/kernels/test_fp4_moe.py" "$OLDPWD/tests/kernels/test_fp4_moe_wgmma.py" \
  "$OLDPWD/tests/quant/test_frozen_kernel_training.py") > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; grep -E "PASSED|FAILED|ERROR|rc=|passed|failed" "$R/gpu_tests.log" | cut -c1-160 | tail -n 24
