#!/usr/bin/env bash
# Run as: OUT=$OUT bash docs/runs/h200_102/cmd.sh, at commit 77baf8d.
# Device call h200_102 (issue 31): are the 192-row expert kernels held by whole waves of programs? At 192 rows
# (12 slots an expert, 16-token blocks) gate/up runs ~1,680 programs at 6 an SM (792 at once: 2.1 waves) and down
# ~4,480 at 8 (4.2 waves). Triton 3.9's ptxas fits the 16-token gate/up in 71 registers (7 an SM) with the same
# loop and no spills. (1) One expert call at batches 128-256 (the whole call, CUDA graph, 8 weight copies): the
# entry as committed and with the register caps that change programs per SM; (2) the decode step, two rounds each,
# 128/192/256 rows.
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/r; mkdir -p "$R"
E16='"wgmma": true, "block_t": 16, "block_n_gate_up": 64, "block_n_down": 64, "block_k": 128, "num_warps": 4, "slice_buffers": true, "gate_first": true'
timeout 150 python3 -m benchmarks.kernels.fp4_moe_tune --batches 128,160,176,192,208,224,256 --budget-s 120 \
  --configs "[{$E16, \"maxnreg\": 80, \"maxnreg_down\": 64}, {$E16, \"maxnreg\": 72, \"maxnreg_down\": 64},
              {$E16, \"maxnreg\": 80, \"maxnreg_down\": 56}, {$E16, \"maxnreg\": 72, \"maxnreg_down\": 56}]" \
  --out "$OUT/expert_call_caps.json" > "$R/tune.log" 2>&1
echo "tune rc=$? at $((SECONDS - START)) s"
python3 - "$OUT/expert_call_caps.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("rows", []):
    if "us" in r:
        print(r["batch"], r.get("block_t"), r.get("maxnreg"), r.get("maxnreg_down"), f"{r['us']:.1f} us", f"{r['vs_bf16']:.2f}x")
PY
AB_ARGS="--setups fast_fp4 --batches 128,192,256 --contexts 1024" VARIANTS='{
 "g72": {"WGMMA8": {"maxnreg": 72}}, "d56": {"WGMMA8": {"maxnreg_down": 56}},
 "g72d56": {"WGMMA8": {"maxnreg": 72, "maxnreg_down": 56}}, "g80_32t": {"WGMMA16": {"maxnreg": 80}}}' \
  OUT="$R" timeout 260 python3 -m benchmarks.kernels.hopper_ab > "$R/ab.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s"
grep -E "^(base|g72|d56|g72d56|g80_32t) " "$R/ab.log" | sed -E 's/^([a-z0-9_]+ [12]) .*(\{.fast_.*)$/\1 \2/' | cut -c1-260
[ -f "$R/hopper_ab.json" ] && cp "$R/hopper_ab.json" "$OUT/"
echo "total $((SECONDS - START)) s"
