#!/usr/bin/env bash
# Device call h200_90 (one H200), issue 31, at commit 70f3073 (branch int). OUT=$OUT bash gpu/call5.sh
# Device call h200_90 (issue 31), the final code with the chunked alignment on: the 8-layer long-tailed GRPO step
# (256 rows x 512 tokens, engine BF16 against engine FP4 + TRACE), and the 16K prefill again (a second sample).
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/r; mkdir -p "$R"
timeout 90 python3 -m benchmarks.rollout.prefill --setups fp4,bf16 --cells 1x16384 --budget-s 80 \
  --out "$OUT/prefill.json" > "$R/prefill.log" 2>&1
echo "prefill rc=$? at $((SECONDS - START)) s"; grep -E "^setup=|^ +1 x" "$R/prefill.log" | cut -c1-200
timeout $((300 - (SECONDS - START))) python3 -m benchmarks.training.grpo_step --prompts 32 --completion 512 \
  --eos-mean 192 --setups engine_bf16,engine_fp4 --steps 3 --out "$OUT/grpo_step_longtail.json" > "$R/grpo.log" 2>&1
echo "grpo rc=$? at $((SECONDS - START)) s"; tail -n 12 "$R/grpo.log" | cut -c1-250
echo "total $((SECONDS - START)) s"
