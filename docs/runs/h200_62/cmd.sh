#!/usr/bin/env bash
# Device call h200_62 (one H200), the session's last ~370 s: stock transformers `generate`'s decode step at 256 rows x
# 1K context on the full 48-layer Qwen3-30B-A3B shape (issue 30's `generate` BF16 setup did not finish one GRPO step
# in h200_61's 300 s), then issue 31's one-allocation-per-slice wgmma variant (`slice_buffers`) A/B in the decode
# step at 256 and 512 rows, then the wgmma GPU tests (the bit-equality of both layouts). From the root:
#   OUT=$OUT bash docs/runs/h200_62/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
timeout 120 python3 -m benchmarks.rollout.rollout_decode --setups hf --batches 256 --contexts 1024 --budget-s 90 \
  --out "$R/generate_256x1k.json" > "$R/generate_256x1k.log" 2>&1
echo "rc=$? after $((SECONDS - START)) s" >> "$R/generate_256x1k.log"; tail -n 4 "$R/generate_256x1k.log" | cut -c1-400
AB_ARGS="--setups fast_fp4 --batches 256,512 --contexts 1024" VARIANTS='{"sb": {"WGMMA*": {"slice_buffers": true}}}' \
  OUT=$R/ab timeout 150 python3 -m benchmarks.kernels.hopper_ab > "$R/ab.log" 2>&1
echo "rc=$? after $((SECONDS - START)) s" >> "$R/ab.log"; tail -n 12 "$R/ab.log" | cut -c1-300
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
left=$((330 - (SECONDS - START)))
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout $((left > 20 ? left : 20)) python3 -m pytest -v -s -m gpu \
  -p no:cacheprovider --rootdir="$OLDPWD" "$OLDPWD/tests/kernels/test_fp4_moe_wgmma.py") > "$R/wgmma_gpu.log" 2>&1
echo "rc=$?" >> "$R/wgmma_gpu.log"; grep -cE "PASSED" "$R/wgmma_gpu.log"; grep -E "FAILED|ERROR|rc=" "$R/wgmma_gpu.log" | tail -n 6
tar -czf "$OUT/h200_62.tar.gz" -C "$R" .
