#!/usr/bin/env bash
# Device call h200_77 (one H200), issue 31: lower register caps for the WGMMA decode entries, found on CPU with
# Triton 3.6's ptxas (no or 2 reloads a K tile): down 72 (32-token blocks, 7 programs per SM) and 64 (16-token, 8);
# with them gate/up 96 (32-token, 5) and 80 (16-token, 6). The GPU tests of the wgmma kernels (the caps change no bits); the decode
# step at batch 192, 256 and 512 over the variants (two rounds); then, with the best variant applied in-process, the
# issue's 1K goal table (fast BF16 and fast FP4, one run).
#   OUT=$OUT bash docs/runs/h200_77/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 140 python3 -m pytest -v -m gpu -p no:cacheprovider \
  --rootdir="$OLDPWD" "$OLDPWD/tests/kernels/test_fp4_moe_wgmma.py") > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; grep -E "FAILED|ERROR|rc=|passed|failed" "$R/gpu_tests.log" | cut -c1-200 | tail -n 6
echo "tests done at $((SECONDS - START)) s"
AB_ARGS="--setups fast_fp4 --batches 192,256,512 --contexts 1024" \
  VARIANTS='{"dn": {"WGMMA12": {"maxnreg_down": 64}, "WGMMA16": {"maxnreg_down": 72}},
             "gu_dn": {"WGMMA12": {"maxnreg": 80, "maxnreg_down": 64}, "WGMMA16": {"maxnreg": 96, "maxnreg_down": 72}}}' \
  OUT="$R" timeout 150 python3 -m benchmarks.kernels.hopper_ab > "$R/ab.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s"; grep -E "^(base|dn|gu)" "$R/ab.log" | sed -E 's/\[\(.*\)\] //' | cut -c1-250
rm -f "$R"/ab_*_?.json
timeout 130 python3 - "$R" > "$R/goal_table.log" 2>&1 <<'PY'
import json, statistics, sys
from benchmarks.kernels import hopper_ab
from benchmarks.rollout import rollout_decode
from trace_hf.kernels import fp4_moe_configs
R = sys.argv[1]
ab = json.load(open(f"{R}/hopper_ab.json"))
def mean(name):
    return statistics.mean(v for k, cells in ab["tokens_per_s"].items() if k.split()[0] == name for v in cells.values())
best = max(ab["variants"], key=mean)
print("best variant", best, {n: round(mean(n), 1) for n in ab["variants"]}, flush=True)
fp4_moe_configs.WGMMA[:] = hopper_ab.patched_wgmma(list(fp4_moe_configs.WGMMA), ab["variants"][best])
print("WGMMA", fp4_moe_configs.WGMMA, flush=True)
rollout_decode.main(["--setups", "fast_bf16,fast_fp4", "--batches", "1,64,128,192,256,512", "--contexts", "1024",
                     "--budget-s", "110", "--out", f"{R}/rollout_decode_{best}.json"])
PY
echo "goal table rc=$? at $((SECONDS - START)) s"; grep -E "^best|^setup=" "$R/goal_table.log" | cut -c1-120
tar -czf "$OUT/h200_77.tar.gz" -C "$R" .
cp "$R/gpu_tests.log" "$R"/rollout_decode_*.json "$OUT/" 2>/dev/null
[ -f "$R/hopper_ab.json" ] && cp "$R/hopper_ab.json" "$OUT/"
echo "total $((SECONDS - START)) s"
