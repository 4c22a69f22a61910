#!/usr/bin/env bash
# Device call h200_64 (one H200): where the Qwen3.5 decode step's time goes (issue 32: per-kernel profile of the
# 40- and 8-layer hybrid step, FP4 and BF16, Triton delta rule), the 16K prefill against BF16 with its profile
# (issue 31, first run of benchmarks.rollout.prefill), and the GPU tests of the engine and the hinted trainer after
# the scoring-pass packing, group_by_length, the one-sync stale check and `_prefill` split out of `_wave`. From the root:
#   OUT=$OUT bash docs/runs/h200_64/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
run() {  # run NAME SECONDS MODULE ARGS...: one benchmark process under its own timeout
  local name=$1 s=$2; shift 2
  timeout "$s" python3 -m "$@" --out "$R/$name.json" > "$R/$name.log" 2>&1
  echo "rc=$? after $((SECONDS - START)) s" >> "$R/$name.log"; tail -n 3 "$R/$name.log" | cut -c1-600
}
run q35_40l_profile 120 benchmarks.rollout.decode_qwen35 --profile --layers 40 --setups bf16_triton,fp4_triton \
  --cells 64x1024,256x1024
run q35_8l_profile 60 benchmarks.rollout.decode_qwen35 --profile --layers 8 --setups bf16_triton,fp4_triton \
  --cells 64x1024
run prefill 170 benchmarks.rollout.prefill --setups fp4,bf16 --cells 1x16384,16x1024,256x128 --profile
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
t() {  # t SECONDS LOG PYTEST-ARGS...: one GPU test run from $PKG (trace_hf with kernels/ linked in)
  local s=$1 log=$2; shift 2
  (cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout "$s" python3 -m pytest -v -s -m gpu -p no:cacheprovider \
    --rootdir="$OLDPWD" "$@") > "$R/$log" 2>&1
  echo "rc=$?" >> "$R/$log"; grep -E "PASSED|FAILED|ERROR|rc=|assert" "$R/$log" | cut -c1-300 | tail -n 16
}
left=$((570 - (SECONDS - START)))
t $((left > 20 ? left : 20)) gpu_tests.log "$PWD/tests/rollout" "$PWD/tests/hints"
tar -czf "$OUT/h200_64.tar.gz" -C "$R" .
