#!/usr/bin/env bash
# Device call h200_68 (one H200), issue 31: the grouped path for many tokens per expert (`fp4_moe_configs.GROUPED`:
# bf16 decoding + torch grouped GEMM) against the wgmma prefill entry and transformers' BF16 grouped_mm experts,
# one layer from 256 to 16,384 tokens; the whole 48-layer prefill; the FP4-KV attention sweep at Qwen3's heads and
# 128-512 rows; the GPU tests of the experts kernels and the quant modules. From the root:
#   OUT=$OUT bash docs/runs/h200_68/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$R/env.txt" 2>&1
run() {  # run NAME SECONDS MODULE ARGS...: one benchmark process under its own timeout
  local name=$1 s=$2; shift 2
  timeout "$s" python3 -m "$@" --out "$R/$name.json" > "$R/$name.log" 2>&1
  echo "rc=$? after $((SECONDS - START)) s" >> "$R/$name.log"; grep -E '^batch|^best|rc=' "$R/$name.log" | cut -c1-600 | tail -n 8
}
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 110 python3 -m pytest -v -s -m gpu -p no:cacheprovider \
  --rootdir="$OLDPWD" "$OLDPWD/tests/kernels/test_fp4_moe.py" "$OLDPWD/tests/kernels/test_fp4_moe_wgmma.py" \
  "$OLDPWD/tests/quant") > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; grep -E "FAILED|ERROR|rc=|passed|failed" "$R/gpu_tests.log" | cut -c1-200 | tail -n 8
run tune_grouped 100 benchmarks.kernels.fp4_moe_tune --grouped --batches 256,512,1024,2048,4096,16384 --copies 1 \
  --decode-rows 16,64 --budget-s 80
run prefill 150 benchmarks.rollout.prefill --setups fp4,bf16 --cells 1x16384,16x1024,256x128 --profile
grep -E 'over_bf16|ms' "$R/prefill.log" | cut -c1-300 | tail -n 6
run attn_tune_q3 170 benchmarks.kernels.fp4_attention_tune --hopper --cells 512x1024,256x1024,128x1024,256x8192 \
  --block-t 32,64,128 --stages 2,3 --prefetch 0,1 --maxnreg 0 --programs 1056,2112,4224 --min-chunk 64 --budget-s 150
tail -n 8 "$R/attn_tune_q3.log" | cut -c1-400
tar -czf "$OUT/h200_68.tar.gz" -C "$R" .
