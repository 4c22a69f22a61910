#!/usr/bin/env bash
# Device call h200_76 (one H200), issue 31: (1) the hidden activation's quantization at batch 192-512 (3-5 M values,
# past `fp4_quant.CONFIG["small_call"]`, 25 us a layer at 512 rows in k31_2's profile) launched as the small calls
# are (16 or 8 values per thread), A/B in the decode step, two rounds; (2) the 8-layer GRPO step with long-tailed
# lengths (issue 31's GRPO goal) after the WGMMA table changes of h200_74/75.
#   OUT=$OUT bash docs/runs/h200_76/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
AB_ARGS="--setups fast_fp4 --batches 192,256,512 --contexts 1024" \
  VARIANTS='{"sc16": {"fp4_quant.CONFIG": {"small_call": 8388608}},
             "sc8": {"fp4_quant.CONFIG": {"small_call": 8388608, "small_values_per_thread": 8}}}' \
  OUT="$R" timeout 150 python3 -m benchmarks.kernels.hopper_ab > "$R/ab.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s"; grep -E "^(base|sc)" "$R/ab.log" | sed -E 's/\[\(.*\)\] //' | cut -c1-250
rm -f "$R"/ab_*_?.json
timeout 250 python3 -m benchmarks.training.grpo_step --prompts 32 --completion 512 --eos-mean 192 \
  --setups engine_bf16,engine_fp4 --steps 3 --out "$R/grpo_step_longtail.json" > "$R/grpo_step_longtail.log" 2>&1
echo "grpo rc=$? at $((SECONDS - START)) s"; grep -E "^(setup|engine)|rollout tokens" "$R/grpo_step_longtail.log" | cut -c1-250 | tail -n 8
tail -n 4 "$R/grpo_step_longtail.log" | cut -c1-300
tar -czf "$OUT/h200_76.tar.gz" -C "$R" .
cp "$R/grpo_step_longtail.json" "$OUT/" 2>/dev/null
[ -f "$R/hopper_ab.json" ] && cp "$R/hopper_ab.json" "$OUT/"
echo "total $((SECONDS - START)) s"
