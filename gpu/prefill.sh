#!/usr/bin/env bash
# Issue 31, goal "prefill of 16K prompt tokens, FP4 at least 1.0x BF16" (branch prefill). Two new switches, both off:
# - `fp4_moe_configs.GROUPED["fp32_sums"]`: the default FP4 forward (no bf16_sums) takes the grouped path too, through
#   Triton grouped GEMMs (`fp4_moe._grouped_gemm_kernel`: wgmma, fp32 accumulators) on the operands decoded once per
#   call, SiLU * up and the down epilogue fused into the GEMMs: the wgmma kernels' function (fp32 sums). torch's
#   grouped_mm has no fp32 output on its fast path (it falls back to one mm per expert after a host sync).
# - `rollout.LOAD_KV_KERNEL`: `_load_cache` copies each FP4 KV layer in one Triton launch (`decode_ops.load_fp4_kv`,
#   the same bits) instead of 12 torch launches (h200_72: FP4 load 17.5 ms, BF16 6.7 ms).
# Three steps, ~140 s of GPU time:
#   1. GPU tests: the grouped paths (bf16 sums; fp32 sums at Qwen3 shapes: the reference, within 1e-3 of the wgmma
#      kernels) and the load kernel (bit for bit with the torch gathers);
#   2. one 16,384-token expert layer (fp4_moe_tune --grouped, baseline transformers' BF16 grouped_mm): the bf16
#      grouped path (~4.0 ms), the wgmma kernels (~5.2 ms) and the fp32-sum path at 4 tiles; expect it near 4 ms;
#   3. the 48-layer prefill at 1x16384, profiled: fp4 (default), fp4_grouped_fp32 (both switches: forward_ms shows
#      the first, load_cache_ms the second), bf16 (the opt-in is left out for time: step 2 compares it per layer).
# Decide: flip fp32_sums on if fp4_grouped_fp32's forward_ms is >= 5% under fp4's and the tests pass; flip the load
# kernel on if its load_cache_ms is under fp4's. Goal: fp4_grouped_fp32 / bf16 prefill_ms <= 1.0 (h200_72: fp4
# 662.7, opt-in 602.2, bf16 577.4 ms).
# From the repo root: OUT=$OUT bash gpu/prefill.sh   (results: $OUT/prefill/{prefill.json,log.txt})
set -u -o pipefail
export PYTHONUNBUFFERED=1
START=$SECONDS
R=$OUT/prefill; mkdir -p "$R"; LOG=$R/log.txt
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
T=$PWD/tests
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 75 python3 -m pytest -q -m gpu -k "grouped or load_kernel" \
  -p no:cacheprovider --rootdir="$OLDPWD" "$T/kernels/test_fp4_moe.py" "$T/rollout/test_load_fp4_kv.py") 2>&1 \
  | tail -n 25 | tee -a "$LOG"
echo "tests rc=$? at $((SECONDS - START)) s" | tee -a "$LOG"
timeout 70 python3 -m benchmarks.kernels.fp4_moe_tune --grouped --batches 16384 --copies 2 --budget-s 30 \
  --grouped-fp32 128:128:128:64:8:8:3,128:128:256:64:8:8:3,128:128:128:64:8:8:4,64:128:128:64:8:4:4 \
  --out /tmp/tune.json 2>&1 | tail -n 4 | tee -a "$LOG"
python3 - <<'PY' 2>&1 | tee -a "$LOG"
import json
d = json.load(open("/tmp/tune.json"))
for r in d.get("rows", d if isinstance(d, list) else []):
    kind = "fp32 " + str(r.get("fp32")) if r.get("fp32_sums") else "bf16 grouped" if r.get("grouped") else \
        "wgmma" if r.get("wgmma") else "triton/other"
    print(f"layer 16384: {r.get('us', r.get('error'))} us  vs_bf16={r.get('vs_bf16')}  {kind}")
PY
echo "tune at $((SECONDS - START)) s" | tee -a "$LOG"
timeout $((215 - (SECONDS - START))) python3 -m benchmarks.rollout.prefill \
  --setups fp4,fp4_grouped_fp32,bf16 --cells 1x16384 --profile --budget-s 90 --out "$R/prefill.json" \
  > /tmp/prefill.log 2>&1
echo "prefill rc=$? at $((SECONDS - START)) s" | tee -a "$LOG"
grep -E "^setup|rows x|^ +1 x|^setup +cell|^ *(fp4|bf16|fp4_\w+) +1x|Error|error" /tmp/prefill.log | cut -c1-240 \
  | tee -a "$LOG"
sed -n '/^top kernels, fp4_grouped_fp32/,/^$/p' /tmp/prefill.log | cut -c1-140 | tee -a "$LOG"
echo "total $((SECONDS - START)) s" | tee -a "$LOG"
