#!/usr/bin/env bash
# Run as: OUT=$OUT bash docs/runs/h200_92/cmd.sh, at commit 7beac3f.
# Device call h200_92 (issue 31): where the three missed goals lose, before changing anything.
# (1) the 8-layer long-tailed GRPO rollout, profiled by kernel (both engines); (2) the 48-layer 1K decode step at
# batch 1, 192 and 256, profiled by kernel (both precisions); (3) Nsight Compute counters of the routed experts
# (FP4 at batch 1, 192 and 256; BF16 at 256); (4) A/B of two expert-table variants at 192 and 256 rows.
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/r; mkdir -p "$R/ncu"
timeout 200 python3 -m benchmarks.training.grpo_step --prompts 32 --completion 512 --eos-mean 192 \
  --setups engine_bf16,engine_fp4 --steps 3 --profile rollout --out "$OUT/grpo_rollout_profile.json" > "$R/grpo.log" 2>&1
echo "grpo rc=$? at $((SECONDS - START)) s"; tail -n 6 "$R/grpo.log" | cut -c1-250
timeout 120 python3 -m benchmarks.rollout.rollout_decode --setups fast_bf16,fast_fp4 --batches 1,192,256 \
  --contexts 1024 --steps 20 --profile --budget-s 110 --out "$OUT/decode_profile.json" > "$R/decode.log" 2>&1
echo "decode rc=$? at $((SECONDS - START)) s"; grep -E "^setup=" "$R/decode.log" | cut -c1-110
NCU="ncu --clock-control none --profile-from-start off --set full"
for spec in "fp4 1" "fp4 192" "fp4 256" "bf16 256"; do
  set -- $spec
  timeout 60 $NCU -o "$R/ncu/experts_$1_b$2" python3 -m benchmarks.kernels.ncu_call experts --path $1 --batch $2 \
    > "$R/ncu/experts_$1_b$2.log" 2>&1; echo "ncu $1 $2 rc=$? at $((SECONDS - START)) s"
done
for f in "$R"/ncu/*.ncu-rep; do ncu --import "$f" --page raw --csv > "${f%.ncu-rep}.raw.csv" 2>/dev/null; done
python3 -m benchmarks.kernels.ncu_summary "$R"/ncu/*.raw.csv --out "$OUT/ncu_summary.json" 2>&1 | cut -c1-250 | head -n 30
T16F='{"block_t": 16, "block_n_gate_up": 64, "block_n_down": 64, "block_k": 128, "num_warps": 4, "slice_buffers": true, "gate_first": true, "maxnreg": 80, "maxnreg_down": 64, "fused_hidden": true}'
AB_ARGS="--setups fast_fp4 --batches 192,256 --contexts 1024" \
  VARIANTS="{\"fused12\": {\"WGMMA12\": {\"fused_hidden\": true}}, \"t16_at16\": {\"WGMMA16\": $T16F}}" \
  OUT="$R" timeout $((560 - (SECONDS - START))) python3 -m benchmarks.kernels.hopper_ab > "$R/ab.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s"; grep -E "^(base|fused12|t16)" "$R/ab.log" | sed -E 's/\[\(.*\)\] //' | cut -c1-250
[ -f "$R/hopper_ab.json" ] && cp "$R/hopper_ab.json" "$OUT/"
tar -czf "$OUT/logs.tar.gz" -C "$R" --exclude='*.ncu-rep' .
echo "total $((SECONDS - START)) s"
