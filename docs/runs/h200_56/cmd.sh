#!/usr/bin/env bash
# Device call h200_56 (one H200): the GPU tests not run since the compaction merge (the engine's waves, the fast
# decode's graphs and PDL, the Gated DeltaNet step kernel on CUDA), then issue 30's 256 x 1K GRPO step of the full
# 48-layer Qwen3-30B-A3B shape after the use_hints fix (one walk of the model per micro-batch), FP4 and BF16 in
# their own processes, the last one given what is left of the call. One tarball comes back. From the root:
#   OUT=$OUT bash docs/runs/h200_56/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS; END_S=${END_S:-585}
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
t 100 engine_gpu.log "$PWD/tests/rollout/test_engine_waves.py" "$PWD/tests/rollout/test_fast_decode.py" \
  "$PWD/tests/rollout/test_qwen35_engine.py::test_gated_delta_step_kernel_is_transformers_recurrent_step"
C="--layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 2"
run() {  # run SETUP SECONDS
  timeout "$2" python3 -m benchmarks.training.grpo_step $C --setups "$1" --out "$R/grpo_30b_256x1k_$1.json" \
    > "$R/grpo_30b_256x1k_$1.log" 2>&1
  echo "rc=$? after $((SECONDS - START)) s" >> "$R/grpo_30b_256x1k_$1.log"
  grep -E '^\{"setup"|rc=|Error' "$R/grpo_30b_256x1k_$1.log" | cut -c1-900 | tail -n 3
}
run engine_fp4 ${FP4_S:-270}
run engine_bf16 $((END_S - (SECONDS - START)))
tar -czf "$OUT/h200_56.tar.gz" -C "$R" .
