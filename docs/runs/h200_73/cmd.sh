#!/usr/bin/env bash
# Device call h200_73 (one H200), issue 31: where the unmet goals lose, measured before changing anything.
# (1) Nsight Compute counters of the wgmma experts at batch 512 (decode, 4,096 slots) and of the FP4-KV attention
# at 384 rows x 8K; (2) the 48-layer decode step at 8K, 384 rows, profiled by kernel; (3) one routed-experts layer at
# batch 128 (1,024 slots): the decode kernels (`HOPPER`, current) against the wgmma kernels with 16- and 32-token
# blocks; (4) the decode step at batch 128 with the wgmma kernels moved down to 8 slots per expert (A/B).
#   OUT=$OUT bash docs/runs/h200_73/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R/ncu"
timeout 90 python3 -m benchmarks.kernels.fp4_moe_tune --wgmma --batches 128 --wg-block-t 16,32 --wg-block-n 64,128 \
  --wg-warps 4 --wg-slice-buffers 1 --budget-s 70 --out "$R/tune_b128.json" > "$R/tune_b128.log" 2>&1
echo "tune rc=$? at $((SECONDS - START)) s"; grep -E "batch|Triton" "$R/tune_b128.log" | cut -c1-300
W16='{"block_t": 16, "block_n_gate_up": 64, "block_n_down": 64, "block_k": 128, "num_warps": 4, "slice_buffers": true}'
W32='{"block_t": 32, "block_n_gate_up": 64, "block_n_down": 64, "block_k": 128, "num_warps": 4, "slice_buffers": true}'
W64='{"block_t": 64, "block_n_gate_up": 128, "block_n_down": 128, "block_k": 128, "num_warps": 4}'
AB_ARGS="--setups fast_fp4 --batches 128,192 --contexts 1024" \
  VARIANTS="{\"wg8_t16\": {\"WGMMA\": [[8, $W16], [16, $W32], [48, $W64]]}}" \
  OUT="$R" timeout 160 python3 -m benchmarks.kernels.hopper_ab > "$R/ab_b128.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s"; grep -E "^(base|wg8)" "$R/ab_b128.log" | sed -E 's/\[\(.*\)\] //' | cut -c1-250
rm -f "$R"/ab_*_?.json
NCU="ncu --clock-control none --profile-from-start off --set full"
timeout 80 $NCU -o "$R/ncu/experts_fp4_b512" python3 -m benchmarks.kernels.ncu_call experts --path fp4 --batch 512 \
  > "$R/ncu/experts.log" 2>&1; echo "ncu experts rc=$? at $((SECONDS - START)) s"
timeout 80 $NCU -o "$R/ncu/attn_fp4_b384_t8192" python3 -m benchmarks.kernels.ncu_call attention --path fp4 \
  --batch 384 --context 8192 > "$R/ncu/attn.log" 2>&1; echo "ncu attention rc=$? at $((SECONDS - START)) s"
for f in "$R"/ncu/*.ncu-rep; do ncu --import "$f" --page raw --csv > "${f%.ncu-rep}.raw.csv" 2>/dev/null; done
python3 -m benchmarks.kernels.ncu_summary "$R"/ncu/*.raw.csv --out "$R/ncu_summary.json" 2>&1 | cut -c1-250 | head -n 20
rm -f "$R"/ncu/*.ncu-rep
timeout 120 python3 -m benchmarks.rollout.rollout_decode --setups fast_fp4 --batches 384 --contexts 8192 --profile \
  --steps 10 --budget-s 110 --out "$R/decode_8k_profile.json" > "$R/decode_8k.log" 2>&1
echo "decode 8K rc=$? at $((SECONDS - START)) s"; grep -E "tokens/s|fast_fp4" "$R/decode_8k.log" | tail -n 4 | cut -c1-200
tar -czf "$OUT/h200_73.tar.gz" -C "$R" .
cp "$R/ncu_summary.json" "$R/decode_8k_profile.json" "$R/tune_b128.json" "$OUT/" 2>/dev/null
[ -f "$R/hopper_ab.json" ] && cp "$R/hopper_ab.json" "$OUT/"
echo "total $((SECONDS - START)) s"
