#!/usr/bin/env bash
# Device call h200_58 (one H200): the frozen experts' kernel-training GPU test (routing-weight gradient now from the
# forward kernel's FP4 hidden, bound 1e-2), then issue 30's 64 x 8K GRPO step of the full 48-layer Qwen3-30B-A3B
# shape again, now that each micro-batch's forward skips the padding columns no row of it uses (h200_57 ran out of
# time in the second step of each setup), FP4 and BF16 in their own processes. From the root:
#   OUT=$OUT bash docs/runs/h200_58/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS; END_S=${END_S:-585}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 45 python3 -m pytest -v -s -m gpu -p no:cacheprovider \
  --rootdir="$OLDPWD" "$OLDPWD/tests/quant/test_frozen_kernel_training.py") > "$R/frozen_kernel.log" 2>&1
echo "rc=$?" >> "$R/frozen_kernel.log"; grep -E "PASSED|FAILED|ERROR|rc=|error|assert" "$R/frozen_kernel.log" | cut -c1-300 | tail -n 8
C="--layers 48 --freeze-experts --lora-r 32 --prompts 8 --completion 8192 --eos-mean 3072 --micro-batch 1 --steps 2"
run() {  # run SETUP SECONDS
  timeout "$2" python3 -m benchmarks.training.grpo_step $C --setups "$1" --out "$R/grpo_30b_64x8k_$1.json" \
    > "$R/grpo_30b_64x8k_$1.log" 2>&1
  echo "rc=$? after $((SECONDS - START)) s" >> "$R/grpo_30b_64x8k_$1.log"
  grep -E '^\{"setup"|rc=|Error' "$R/grpo_30b_64x8k_$1.log" | cut -c1-900 | tail -n 3
  grep -oE "'step_time': '[^']*'" "$R/grpo_30b_64x8k_$1.log"
}
run engine_fp4 ${FP4_S:-295}
run engine_bf16 $((END_S - (SECONDS - START)))
tar -czf "$OUT/h200_58.tar.gz" -C "$R" .
