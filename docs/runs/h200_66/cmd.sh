#!/usr/bin/env bash
# Device call h200_66 (one H200), issue 32's 32K goal: the Gated DeltaNet rule's launch sweep (gated_delta.CONFIG),
# the FP4-KV Gluon attention's sweep at Qwen3.5's heads (16 query / 2 KV of 256), then the 40-layer decode with the
# rule split over value columns again (the committed CONFIG) at 64 x 1K and the best batches at 32K, and the GPU
# test of the rule in both launch shapes. From the root:
#   OUT=$OUT bash docs/runs/h200_66/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
run() {  # run NAME SECONDS MODULE ARGS...: one benchmark process under its own timeout
  local name=$1 s=$2; shift 2
  timeout "$s" python3 -m "$@" --out "$R/$name.json" > "$R/$name.log" 2>&1
  echo "rc=$? after $((SECONDS - START)) s" >> "$R/$name.log"; grep -E '^best|rc=' "$R/$name.log" | cut -c1-900 | tail -n 4
}
run gated_delta_tune 80 benchmarks.kernels.gated_delta_tune
run attn_tune_q35 200 benchmarks.kernels.fp4_attention_tune --hopper --heads 16,2,256 \
  --cells 384x32768,96x32768,64x32768 --block-t 32,64,128 --stages 0,2,3 --prefetch 0 --maxnreg 0 \
  --programs 528,1056,2112 --min-chunk 64 --budget-s 170
tail -n 12 "$R/attn_tune_q35.log" | cut -c1-400
run q35_40l 130 benchmarks.rollout.decode_qwen35 --layers 40 --setups bf16_triton,fp4_triton \
  --cells 64x1024,96x32768,384x32768,448x32768
grep -E '"best"|fp4_triton_over' "$R/q35_40l.log" | cut -c1-600 | tail -n 2
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 90 python3 -m pytest -v -s -m gpu -p no:cacheprovider \
  --rootdir="$OLDPWD" "$OLDPWD/tests/rollout/test_qwen35_engine.py") > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; grep -E "PASSED|FAILED|ERROR|rc=" "$R/gpu_tests.log" | cut -c1-200 | tail -n 12
tar -czf "$OUT/h200_66.tar.gz" -C "$R" .
