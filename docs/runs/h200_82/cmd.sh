#!/usr/bin/env bash
# Device call h200_82 (one H200), issue 31: (1) whether torch.isin can be captured with a dozen EOS ids (the capture
# failure of h200_81's compaction test); (2) the rollout GPU tests with the runner's broadcast compare instead;
# (3) per-kernel profiles of the decode step without programmatic dependent launch (with it, a kernel's time
# includes its wait on the one before, so the times overlap): batch 1 and 256, 1K context, both precisions.
#   OUT=$OUT bash docs/runs/h200_82/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
timeout 60 python3 docs/runs/h200_82/isin_capture.py > "$R/isin_capture.log" 2>&1; echo "isin rc=$?"; cat "$R/isin_capture.log" | grep rows= | head -20
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider \
  --rootdir="$OLDPWD" "$OLDPWD/tests/rollout") > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; grep -E "FAILED|ERROR|rc=|passed|failed" "$R/gpu_tests.log" | cut -c1-200 | tail -n 8
echo "tests done at $((SECONDS - START)) s"
timeout 150 python3 -m benchmarks.rollout.rollout_decode --setups fast_bf16,fast_fp4 --batches 1,256 --contexts 1024 \
  --profile --no-pdl --steps 10 --budget-s 120 --out "$R/decode_profile_nopdl.json" > "$R/decode_profile_nopdl.log" 2>&1
echo "decode rc=$? at $((SECONDS - START)) s"; grep -E "^setup=" "$R/decode_profile_nopdl.log" | cut -c1-120
tar -czf "$OUT/h200_82.tar.gz" -C "$R" .
cp "$R/gpu_tests.log" "$R/isin_capture.log" "$R/decode_profile_nopdl.json" "$OUT/" 2>/dev/null
echo "total $((SECONDS - START)) s"
