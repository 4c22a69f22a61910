#!/usr/bin/env bash
# Device call h200_69 (one H200), issue 31 after h200_68: the grouped path with the cheap bf16 decoding, its slot
# sum fused into the epilogue (`reduce`), `GROUPED["from"]` = 384 per expert; the GPU tests of the experts kernels
# and the frozen-experts training path; one layer at 4K-16K tokens; the whole prefill; the 8-layer GRPO step with
# long-tailed lengths (rollout ratio and trace/kl_rollout_train against h200_54); the 48-layer decode at 8K. From
# the root:
#   OUT=$OUT bash docs/runs/h200_69/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
run() {  # run NAME SECONDS MODULE ARGS...: one benchmark process under its own timeout
  local name=$1 s=$2; shift 2
  timeout "$s" python3 -m "$@" --out "$R/$name.json" > "$R/$name.log" 2>&1
  echo "rc=$? after $((SECONDS - START)) s" >> "$R/$name.log"; grep -E '^batch|^best|rc=' "$R/$name.log" | cut -c1-400 | tail -n 5
}
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 90 python3 -m pytest -v -s -m gpu -p no:cacheprovider \
  --rootdir="$OLDPWD" "$OLDPWD/tests/kernels/test_fp4_moe.py" "$OLDPWD/tests/quant/test_frozen_kernel_training.py") \
  > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; grep -E "FAILED|ERROR|rc=|passed|failed|relative error" "$R/gpu_tests.log" | cut -c1-200 | tail -n 8
run tune_grouped 60 benchmarks.kernels.fp4_moe_tune --grouped --batches 2048,4096,8192,16384 --copies 1 --budget-s 45
run prefill 120 benchmarks.rollout.prefill --setups fp4,bf16 --cells 1x16384,16x1024,256x128 --profile
grep -E '^setup=' "$R/prefill.log" | cut -c1-200
timeout 170 python3 -m benchmarks.training.grpo_step --prompts 32 --completion 512 --eos-mean 192 \
  --setups engine_bf16,engine_fp4 --steps 3 --out "$R/grpo_step_longtail.json" > "$R/grpo_step_longtail.log" 2>&1
echo "grpo rc=$? after $((SECONDS - START)) s" >> "$R/grpo_step_longtail.log"; tail -n 6 "$R/grpo_step_longtail.log" | cut -c1-300
left=$((580 - (SECONDS - START)))
timeout $((left > 30 ? left : 30)) python3 -m benchmarks.rollout.rollout_decode --setups fast_bf16,fast_fp4 \
  --batches 96,128,256,384 --contexts 8192 --budget-s $((left > 80 ? left - 50 : 30)) --out "$R/decode_8k.json" > "$R/decode_8k.log" 2>&1
echo "rc=$? after $((SECONDS - START)) s" >> "$R/decode_8k.log"; tail -n 12 "$R/decode_8k.log" | cut -c1-250
tar -czf "$OUT/h200_69.tar.gz" -C "$R" .
