#!/usr/bin/env bash
# Run as: OUT=$OUT bash docs/runs/h200_101/cmd.sh, at commit 77baf8d.
# Device call h200_101 (issue 31): (1) every GPU-marked test at the final code of session 24 (h200_100's were cut at
# 100 s: the WGMMA table without fused_hidden and the padding skip never had the whole Gluon suite); (2) the
# full-depth GRPO step of the full-size issue (48 layers, frozen experts + LoRA r=32, 256 x 1K, long-tailed), both
# precisions, each in its own process, the command of h200_56 (1.31x rollout then), now with issue 31's kernels.
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/r; mkdir -p "$R"
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
T=$PWD/tests
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 \
  --rootdir="$OLDPWD" "$T") > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? at $((SECONDS - START)) s"; grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tests.log" | tail -12
C="--layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 2"
run() {  # run SETUP SECONDS
  timeout "$2" python3 -m benchmarks.training.grpo_step $C --setups "$1" --out "$OUT/grpo_30b_256x1k_$1.json" \
    > "$R/grpo_30b_256x1k_$1.log" 2>&1
  echo "$1 rc=$? after $((SECONDS - START)) s"
  tail -n 30 "$R/grpo_30b_256x1k_$1.log" | grep -vE '^\{"setup"' | cut -c1-300 | tail -n 8
}
run engine_fp4 230
run engine_bf16 $((585 - (SECONDS - START)))
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/grpo_30b_*.json")):
    for r in json.load(open(f))["results"]:
        if "error" in r:
            print(r["setup"], r["error"]); continue
        st = r.get("engine_last_rollout") or {}
        print(f"{r['setup']}: rollout {r['rollout_tokens_per_s']:,.0f} tok/s {r['rollout_s']:.2f} s; step {r['step_s']:.2f} s "
              f"(all {r['step_s_all']}); train side {r['train_side_s']:.2f}; peak {r['peak_gib']:.1f} GiB; mean len "
              f"{r['completion_mean_length']:.0f}; buckets {st.get('bucket_trajectory')}; phases {r['phases_last_step']}")
PY
echo "total $((SECONDS - START)) s"
