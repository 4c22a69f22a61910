#!/usr/bin/env bash
# Device call h200_74 (one H200), issue 31: the wgmma gate/up loop with gate's MMAs waited for before up's decoding
# (`gate_first`: 134 registers instead of 161 at 32-token blocks, h200_73's Nsight Compute found gate/up waiting on
# its loads with 2.85 warps per scheduler) and a register cap (`maxnreg` 128: 4 programs per SM). The GPU tests of
# the wgmma kernels (bit equality of the loop variants included); one layer at batch 192, 256 and 512 over the
# variants; the 48-layer decode step at the same batches (A/B, two rounds).
#   OUT=$OUT bash docs/runs/h200_74/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider \
  --rootdir="$OLDPWD" "$OLDPWD/tests/kernels/test_fp4_moe_wgmma.py") > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; grep -E "FAILED|ERROR|rc=|passed|failed" "$R/gpu_tests.log" | cut -c1-200 | tail -n 6
echo "tests done at $((SECONDS - START)) s"
timeout 110 python3 -m benchmarks.kernels.fp4_moe_tune --wgmma --batches 192,256,512 --wg-block-t 16,32 --wg-block-n 64 \
  --wg-warps 4 --wg-slice-buffers 1 --wg-gate-first 0,1 --wg-maxnreg 0,128 --budget-s 95 --out "$R/tune.json" \
  > "$R/tune.log" 2>&1
echo "tune rc=$? at $((SECONDS - START)) s"; grep -E "^batch" "$R/tune.log" | cut -c1-300
python3 - "$R/tune.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
rows = d["rows"] if isinstance(d, dict) and "rows" in d else d
for r in rows:
    if "us" in r:
        print(r["batch"], r.get("block_t"), "gf", r.get("gate_first"), "mr", r.get("maxnreg"), f"{r['us']:.1f} us")
PY
AB_ARGS="--setups fast_fp4 --batches 192,256,512 --contexts 1024" \
  VARIANTS='{"gf": {"WGMMA12": {"gate_first": true}, "WGMMA16": {"gate_first": true}},
             "gf_r128": {"WGMMA12": {"gate_first": true, "maxnreg": 128}, "WGMMA16": {"gate_first": true, "maxnreg": 128}}}' \
  OUT="$R" timeout 230 python3 -m benchmarks.kernels.hopper_ab > "$R/ab.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s"; grep -E "^(base|gf)" "$R/ab.log" | sed -E 's/\[\(.*\)\] //' | cut -c1-250
rm -f "$R"/ab_*_?.json
tar -czf "$OUT/h200_74.tar.gz" -C "$R" .
cp "$R/tune.json" "$R/gpu_tests.log" "$OUT/" 2>/dev/null
[ -f "$R/hopper_ab.json" ] && cp "$R/hopper_ab.json" "$OUT/"
echo "total $((SECONDS - START)) s"
