#!/usr/bin/env bash
# Device call h200_57 (one H200): issue 30's 64 x 8K GRPO step of the full 48-layer Qwen3-30B-A3B shape (EOS mean
# 3,072, one row per training micro-batch), FP4 and BF16 in their own processes, each engine admitting the rows
# that fit, the last setup given what is left of the call. One tarball comes back. From the root:
#   OUT=$OUT bash docs/runs/h200_57/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS; END_S=${END_S:-588}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
C="--layers 48 --freeze-experts --lora-r 32 --prompts 8 --completion 8192 --eos-mean 3072 --micro-batch 1 --steps 2"
run() {  # run SETUP SECONDS
  timeout "$2" python3 -m benchmarks.training.grpo_step $C --setups "$1" --out "$R/grpo_30b_64x8k_$1.json" \
    > "$R/grpo_30b_64x8k_$1.log" 2>&1
  echo "rc=$? after $((SECONDS - START)) s" >> "$R/grpo_30b_64x8k_$1.log"
  grep -E '^\{"setup"|rc=|Error|step_time' "$R/grpo_30b_64x8k_$1.log" | cut -c1-900 | tail -n 4
}
run engine_fp4 ${FP4_S:-300}
run engine_bf16 $((END_S - (SECONDS - START)))
tar -czf "$OUT/h200_57.tar.gz" -C "$R" .
