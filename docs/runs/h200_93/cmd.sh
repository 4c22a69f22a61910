#!/usr/bin/env bash
# Run as: OUT=$OUT bash docs/runs/h200_93/cmd.sh, at commit 7beac3f (the code; docs at a0fca95+).
# Device call h200_93 (issue 31): launch-table A/B (no code change) for the two narrowly missed decode goals and the
# GRPO rollout's bucket: batch 1 (HOPPER[0]: split-K 1 with the fused hidden quantization, split-K 2) and 192/256
# rows (the WGMMA entries at 12 and 16 slots per expert: register caps either side of today's, 128-row down tiles).
# Two rounds of each variant, 48 layers, 1K context (benchmarks.kernels.hopper_ab).
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/r; mkdir -p "$R"
AB_ARGS="--setups fast_fp4 --batches 1,192,256 --contexts 1024" VARIANTS='{
 "b1_split1_fused": {"8": {"split_k": 1, "fused_hidden": true}},
 "b1_split2": {"8": {"split_k": 2}},
 "wg16_gu104": {"WGMMA16": {"maxnreg": 104}},
 "wg16_gu88": {"WGMMA16": {"maxnreg": 88}},
 "wg16_dn80": {"WGMMA16": {"maxnreg_down": 80}},
 "wg16_dn64": {"WGMMA16": {"maxnreg_down": 64}},
 "wg16_bnd128": {"WGMMA16": {"block_n_down": 128}},
 "wg12_gu96": {"WGMMA12": {"maxnreg": 96}},
 "wg12_dn72": {"WGMMA12": {"maxnreg_down": 72}}}' \
  OUT="$R" timeout 480 python3 -m benchmarks.kernels.hopper_ab > "$R/ab.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s"
grep -E "^(base|b1_|wg1)" "$R/ab.log" | sed -E 's/^([a-z0-9_]+ [12]) .*(\{.fast_fp4.*)$/\1 \2/' | cut -c1-250
grep -E "Error|error" "$R/ab.log" | head -5
[ -f "$R/hopper_ab.json" ] && cp "$R/hopper_ab.json" "$OUT/"
cp "$R/ab.log" "$OUT/"
echo "total $((SECONDS - START)) s"
