#!/usr/bin/env bash
# Device call h200_60 (one H200): issue 30's 64 x 8K GRPO step of the full 48-layer Qwen3-30B-A3B shape, BF16 with
# frozen BF16 experts, two steps (h200_59 ran FP4), then the GPU tests of tests/hints/ and of the frozen experts +
# LoRA path, not run since the trainer's use_hints and padding changes. From the root:
#   OUT=$OUT bash docs/runs/h200_60/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
C="--layers 48 --freeze-experts --lora-r 32 --prompts 8 --completion 8192 --eos-mean 3072 --micro-batch 1 --steps 2"
S=engine_bf16
timeout "${BF16_S:-470}" python3 -m benchmarks.training.grpo_step $C --setups $S --out "$R/grpo_30b_64x8k_$S.json" \
  > "$R/grpo_30b_64x8k_$S.log" 2>&1
echo "rc=$? after $((SECONDS - START)) s" >> "$R/grpo_30b_64x8k_$S.log"
grep -E '^STEP|rc=|Error' "$R/grpo_30b_64x8k_$S.log" | cut -c1-1500 | tail -n 4
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
t() {  # t SECONDS LOG PYTEST-ARGS...: one GPU test run from $PKG (trace_hf with kernels/ linked in)
  local s=$1 log=$2; shift 2
  (cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout "$s" python3 -m pytest -v -s -m gpu -p no:cacheprovider \
    --rootdir="$OLDPWD" "$@") > "$R/$log" 2>&1
  echo "rc=$?" >> "$R/$log"; grep -E "PASSED|FAILED|ERROR|rc=|assert" "$R/$log" | cut -c1-300 | tail -n 12
}
left=$((575 - (SECONDS - START)))
t $((left > 20 ? left : 20)) trainer_gpu.log "$PWD/tests/hints/test_hint_sites.py" "$PWD/tests/hints/test_hints.py" \
  "$PWD/tests/quant/test_frozen_experts_lora.py"
tar -czf "$OUT/h200_60.tar.gz" -C "$R" .
