#!/usr/bin/env bash
# Device call h200_55 (one H200): the GPU tests that h200_54's 200 s test budget cut off or failed, one file at a
# time with -v (the frozen experts' kernel training, Qwen3.5's engine with the Triton delta rule and compaction, the
# Qwen3 engine's graphs), then issue 30's 256 x 1K GRPO step of the full 48-layer Qwen3-30B-A3B shape, FP4 and BF16
# in their own processes (a timeout in one keeps the other). One tarball comes back. From the root:
#   OUT=$OUT bash docs/runs/h200_55/cmd.sh
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
t() {  # t SECONDS LOG PYTEST-ARGS...: one GPU test run from $PKG (trace_hf with kernels/ linked in)
  local s=$1 log=$2; shift 2
  (cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout "$s" python3 -m pytest -v -s -m gpu -p no:cacheprovider \
    --rootdir="$OLDPWD" "$@") > "$R/$log" 2>&1
  echo "rc=$?" >> "$R/$log"; grep -E "PASSED|FAILED|ERROR|rc=|assert" "$R/$log" | cut -c1-300 | tail -n 12
}
t 60 frozen_kernel.log "$PWD/tests/quant/test_frozen_kernel_training.py"
t 90 qwen35_gpu.log "$PWD/tests/rollout/test_qwen35_engine.py" "$PWD/tests/rollout/test_engine_compaction.py"
t 60 rollout_gpu.log "$PWD/tests/rollout/test_rollout.py"
C="--layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 2"
for s in engine_fp4 engine_bf16; do
  timeout ${GRPO_S:-165} python3 -m benchmarks.training.grpo_step $C --setups $s --out "$R/grpo_30b_256x1k_$s.json" \
    > "$R/grpo_30b_256x1k_$s.log" 2>&1
  echo "rc=$?" >> "$R/grpo_30b_256x1k_$s.log"
  grep -E '^\{"setup"|rc=|Error' "$R/grpo_30b_256x1k_$s.log" | cut -c1-600 | tail -n 3
done
tar -czf "$OUT/h200_55.tar.gz" -C "$R" .
