#!/usr/bin/env bash
# Device call h200_65 (one H200), issue 32 after the Qwen3.5 decode step's fusions (Gated DeltaNet in two Triton
# launches, q/k norm + partial RoPE folded into qkv_post, the shared expert's gate folded into the next norm): the
# 40-layer decode at 64 x 1K and each setup's best batch at 32K with the per-kernel profile, the 8-layer profile,
# the 8-layer GRPO step against generate, then the GPU tests of the changed kernels (Qwen3.5 engine, attention
# incl. Qwen3's qkv_post path, the Qwen3 decode step). From the root:
#   OUT=$OUT bash docs/runs/h200_65/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
run() {  # run NAME SECONDS MODULE ARGS...: one benchmark process under its own timeout
  local name=$1 s=$2; shift 2
  timeout "$s" python3 -m "$@" --out "$R/$name.json" > "$R/$name.log" 2>&1
  echo "rc=$? after $((SECONDS - START)) s" >> "$R/$name.log"; grep -E '^STEP|rc=' "$R/$name.log" | cut -c1-400 | tail -n 8
}
run q35_40l 150 benchmarks.rollout.decode_qwen35 --profile --layers 40 --setups bf16_triton,fp4_triton \
  --cells 64x1024,64x32768,96x32768,128x32768,256x32768,384x32768,512x32768
run q35_8l 60 benchmarks.rollout.decode_qwen35 --profile --layers 8 --setups bf16_triton,fp4_triton --cells 64x1024
run grpo_step_qwen35 200 benchmarks.training.grpo_step_qwen35 --setups engine_fp4,engine_bf16,generate_bf16 --steps 2
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
t() {  # t SECONDS LOG PYTEST-ARGS...: one GPU test run from $PKG (trace_hf with kernels/ linked in)
  local s=$1 log=$2; shift 2
  (cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout "$s" python3 -m pytest -v -s -m gpu -p no:cacheprovider \
    --rootdir="$OLDPWD" "$@") > "$R/$log" 2>&1
  echo "rc=$?" >> "$R/$log"; grep -E "PASSED|FAILED|ERROR|rc=|assert" "$R/$log" | cut -c1-300 | tail -n 24
}
left=$((575 - (SECONDS - START)))
t $((left > 20 ? left : 20)) gpu_tests.log "$PWD/tests/rollout/test_qwen35_engine.py" \
  "$PWD/tests/kernels/test_fp4_attention.py" "$PWD/tests/kernels/test_fp4_attention_hopper.py" \
  "$PWD/tests/rollout/test_fast_decode.py"
tar -czf "$OUT/h200_65.tar.gz" -C "$R" .
