#!/usr/bin/env bash
# Run as: OUT=$OUT bash docs/runs/h200_103/cmd.sh, at commit adfd2e7.
# Device call h200_103 (issue 31): the wgmma gate/up register cap chosen per call to fill whole waves
# (`fp4_moe_configs.gate_up_cap`). (1) every GPU-marked test; (2) A/B, two rounds, FP4 at 192 and 512 rows, 1K: the
# rule against the fixed caps before it (80 for 16-token blocks, 96 for 32-token); (3) the full-depth GRPO step's FP4
# setup (48 layers, frozen FP4 experts + LoRA, 256 x 1K, long-tailed; h200_101's command; BF16 is unchanged by this
# commit: h200_101); (4) the 8-layer long-tailed GRPO step if time is left.
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
END=520
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/r; mkdir -p "$R"
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
T=$PWD/tests
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 260 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 \
  --rootdir="$OLDPWD" "$T") > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? at $((SECONDS - START)) s"; grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tests.log" | tail -12
AB_ARGS="--setups fast_fp4 --batches 192,512 --contexts 1024" VARIANTS='{
 "fixed": {"WGMMA8": {"maxnreg": 80}, "WGMMA16": {"maxnreg": 96}}}' \
  OUT="$R" timeout 100 python3 -m benchmarks.kernels.hopper_ab > "$R/ab.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s"
grep -E "^(base|fixed) " "$R/ab.log" | sed -E 's/^([a-z0-9_]+ [12]) .*(\{.fast_.*)$/\1 \2/' | cut -c1-260
[ -f "$R/hopper_ab.json" ] && cp "$R/hopper_ab.json" "$OUT/"
C="--layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 2"
LEFT=$((END - (SECONDS - START)))
if [ "$LEFT" -ge 215 ]; then
  timeout "$LEFT" python3 -m benchmarks.training.grpo_step $C --setups engine_fp4 \
    --out "$OUT/grpo_30b_256x1k_engine_fp4.json" > "$R/grpo48.log" 2>&1
  echo "grpo48 rc=$? at $((SECONDS - START)) s"
else
  echo "grpo48 skipped: $LEFT s left"
fi
LEFT=$((END - (SECONDS - START)))
if [ "$LEFT" -ge 120 ]; then
  timeout "$LEFT" python3 -m benchmarks.training.grpo_step --prompts 32 --completion 512 --eos-mean 192 \
    --setups engine_bf16,engine_fp4 --steps 3 --out "$OUT/grpo_step.json" > "$R/grpo8.log" 2>&1
  echo "grpo8 rc=$? at $((SECONDS - START)) s"
else
  echo "grpo8 skipped: $LEFT s left"
fi
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/grpo_*.json")):
    for r in json.load(open(f))["results"]:
        if "error" in r:
            print(r["setup"], r["error"]); continue
        st = r.get("engine_last_rollout") or {}
        print(f"{f.split('/')[-1]} {r['setup']}: rollout {r['rollout_tokens_per_s']:,.0f} tok/s {r['rollout_s']:.3f} s; "
              f"step {r['step_s']:.2f} s (all {r['step_s_all']}); row_steps {st.get('row_steps')}; kept "
              f"{st.get('kept_tokens')}; buckets {st.get('bucket_trajectory')}; peak {r['peak_gib']:.1f} GiB")
PY
echo "total $((SECONDS - START)) s"
