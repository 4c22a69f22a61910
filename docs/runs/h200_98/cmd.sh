#!/usr/bin/env bash
# Run as: OUT=$OUT bash docs/runs/h200_98/cmd.sh, at commit 0a8d610.
# Device call h200_98 (issue 31), main with the attention's new split settings (PDL per split kernel, the fewest
# splits reaching 1,024 programs): (1) the GPU tests of the attention and the decode step; (2) the 1K decode table,
# both precisions in one run; (3) A/B at 256 rows, 1K: 2 splits in one wave (register cap 128: 16 warps an SM, 2,112
# >= 2,048 programs) and 2 splits of 32-token tiles; (4) the 8-layer long-tailed GRPO step (its rollout decodes at 192 rows).
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/r; mkdir -p "$R"
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
T=$PWD/tests
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir="$OLDPWD" \
  "$T/kernels/test_fp4_attention.py" "$T/kernels/test_fp4_attention_hopper.py" "$T/rollout/test_fast_decode.py") \
  > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? at $((SECONDS - START)) s"; tail -2 "$OUT/gpu_tests.log"
timeout 130 python3 -m benchmarks.rollout.rollout_decode --setups fast_bf16,fast_fp4 --batches 1,64,128,256,512 \
  --contexts 1024 --steps 20 --out "$OUT/decode_1k.json" > "$R/decode_1k.log" 2>&1
echo "decode rc=$? at $((SECONDS - START)) s"; grep -E "^setup=" "$R/decode_1k.log" | cut -c1-100
AB_ARGS="--setups fast_fp4 --batches 256 --contexts 1024" VARIANTS='{
 "s2r128": {"fp4_attention.CONFIG": {"hopper": {"target_programs": 2048, "maxnreg": 128}}},
 "s2b32": {"fp4_attention.CONFIG": {"hopper": {"target_programs": 2048, "block_t": 32, "stages": 3}}}}' \
  OUT="$R" timeout 110 python3 -m benchmarks.kernels.hopper_ab > "$R/ab.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s"
grep -E "^(base|s2r128|s2b32) " "$R/ab.log" | sed -E 's/^([a-z0-9_]+ [12]) .*(\{.fast_.*)$/\1 \2/' | cut -c1-200
[ -f "$R/hopper_ab.json" ] && cp "$R/hopper_ab.json" "$OUT/"
timeout $((585 - (SECONDS - START))) python3 -m benchmarks.training.grpo_step --prompts 32 --completion 512 \
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
