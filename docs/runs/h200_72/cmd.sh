#!/usr/bin/env bash
# Device call h200_72 (one H200), issue 31, final: the grouped path now opt-in (`TraceFP4Config.prefill_bf16_gemms`,
# `bf16_sums=True`) and `fp4.pack_bits` without its host-to-device copy (h200_71: 24 syncs per prefill). The GPU tests
# of the experts kernels and the frozen-experts training path; the whole 48-layer prefill with the default FP4 setup,
# the opt-in and BF16, profiled and with `--sync-check`. From the root:
#   OUT=$OUT bash docs/runs/h200_72/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 110 python3 -m pytest -v -s -m gpu -p no:cacheprovider \
  --rootdir="$OLDPWD" "$OLDPWD/tests/kernels/test_fp4_moe.py" "$OLDPWD/tests/quant") > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; grep -E "FAILED|ERROR|rc=|passed|failed" "$R/gpu_tests.log" | cut -c1-200 | tail -n 6
timeout 170 python3 -m benchmarks.rollout.prefill --setups fp4,fp4_bf16_gemms,bf16 --cells 1x16384,16x1024,256x128 \
  --profile --sync-check --budget-s 160 --out "$R/prefill.json" > "$R/prefill.log" 2>&1
echo "rc=$? after $((SECONDS - START)) s" >> "$R/prefill.log"
grep -E '^setup=|rc=' "$R/prefill.log" | sed -E 's/ sync_check=.*syncs.: ([0-9]+).*/ syncs=\1/' | cut -c1-260
tar -czf "$OUT/h200_72.tar.gz" -C "$R" .
