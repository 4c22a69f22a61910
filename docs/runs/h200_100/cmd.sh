#!/usr/bin/env bash
# Run as: OUT=$OUT bash docs/runs/h200_100/cmd.sh, at commit fd0897b.
# Device call h200_100 (issue 31): the hidden activation's quantization skipping moe_align's padding rows (a decode
# step's sorted layout is a static bound: at 192 rows 3,456 rows for 1,536 slots). (1) GPU bit tests of the
# quantization with row ids and of the experts; (2) A/B, two rounds, FP4 at 128-512 rows, 1K: the WGMMA entries
# that quantize the hidden inside gate/up (8 and 16 slots an expert) with and without it, now that the separate
# launch skips the padding; BF16 once for the ratios; (3) the 8-layer long-tailed GRPO step (decodes at 192 rows).
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/r; mkdir -p "$R"
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
T=$PWD/tests
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 100 python3 -m pytest -q -p no:cacheprovider --rootdir="$OLDPWD" \
  "$T/kernels/test_fp4_kernels.py" -k "padding or row_ids or million or modes" && \
  PYTHONPATH=$PKG:$PYTHONPATH timeout 100 python3 -m pytest -q -p no:cacheprovider --rootdir="$OLDPWD" -m gpu \
  "$T/kernels/test_fp4_moe.py" "$T/kernels/test_fp4_moe_wgmma.py" "$T/rollout/test_fast_decode.py") \
  > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? at $((SECONDS - START)) s"; grep -E "passed|failed" "$OUT/gpu_tests.log"
AB_ARGS="--setups fast_fp4 --batches 128,192,256,512 --contexts 1024" VARIANTS='{
 "unfused": {"WGMMA8": {"fused_hidden": false}, "WGMMA16": {"fused_hidden": false}}}' \
  OUT="$R" timeout 170 python3 -m benchmarks.kernels.hopper_ab > "$R/ab.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s"
grep -E "^(base|unfused) " "$R/ab.log" | sed -E 's/^([a-z0-9_]+ [12]) .*(\{.fast_.*)$/\1 \2/' | cut -c1-260
[ -f "$R/hopper_ab.json" ] && cp "$R/hopper_ab.json" "$OUT/"
timeout 60 python3 -m benchmarks.rollout.rollout_decode --setups fast_bf16 --batches 128,192,256,512 --contexts 1024 \
  --out "$OUT/bf16_1k.json" > "$R/bf16.log" 2>&1
echo "bf16 rc=$? at $((SECONDS - START)) s"; grep -E "^setup=" "$R/bf16.log" | cut -c1-90
timeout $((480 - (SECONDS - START))) python3 -m benchmarks.training.grpo_step --prompts 32 --completion 512 \
  --eos-mean 192 --setups engine_bf16,engine_fp4 --steps 3 --out "$OUT/grpo_step.json" > "$R/grpo.log" 2>&1
echo "grpo_step rc=$? at $((SECONDS - START)) s"
python3 - "$OUT/grpo_step.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    if "error" in r:
        print(r["setup"], r["error"]); continue
    st = r["engine_last_rollout"] or {}
    print(f"{r['setup']}: rollout {r['rollout_tokens_per_s']:,.0f} tok/s, {r['rollout_s']:.3f} s; buckets "
          f"{st.get('bucket_trajectory')}; step {r['step_s']:.2f} s")
PY
echo "total $((SECONDS - START)) s"
