#!/usr/bin/env bash
# One device call on the H200: GPU tests of the decode kernels, the rollout-decode benchmark, the train-step
# benchmark. Everything goes under $OUT (default outputs/h200). About 7.5 minutes at most (each part has a
# timeout, so a hang in one part does not lose the others).
#
#   bash benchmarks/h200_decode_run.sh
#
# No pip install: trace_hf is put on PYTHONPATH with kernels/ linked in as trace_hf/kernels (what the editable
# install's package-dir mapping does), so this runs on the machine's own python3 and packages.
set -u
ROOT=$(pwd)
OUT=${OUT:-outputs/h200}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PKG=$(mktemp -d)
cp -r "$ROOT/trace_hf" "$PKG/trace_hf"
rm -rf "$PKG/trace_hf/kernels"
ln -s "$ROOT/kernels" "$PKG/trace_hf/kernels"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
{
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv
  $PY -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== rollout decode benchmark"
timeout $((${ROLLOUT_BUDGET_S:-250} + 60)) $PY benchmarks/rollout_decode.py --out "$OUT/rollout_decode.json" --budget-s ${ROLLOUT_BUDGET_S:-250} \
  > "$OUT/rollout_decode.log" 2>&1
echo "rc=$?" >> "$OUT/rollout_decode.log"
tail -n 25 "$OUT/rollout_decode.log"

echo "== train step benchmark"
timeout 80 $PY benchmarks/train_step.py --out "$OUT/train_step.json" > "$OUT/train_step.log" 2>&1
echo "rc=$?" >> "$OUT/train_step.log"
tail -n 3 "$OUT/train_step.log"

echo "== GPU tests of the decode kernels"
# From $PKG, so that `python -m pytest` (which puts the working directory first on sys.path) finds the
# trace_hf with kernels/ linked in, not the repository's source folder.
(cd "$PKG" && timeout 60 $PY -m pytest -q -m gpu -p no:cacheprovider --rootdir="$ROOT" \
  "$ROOT/tests/test_fp4_moe.py" "$ROOT/tests/test_fp4_attention.py" "$ROOT/tests/test_fast_decode.py") \
  > "$OUT/gpu_decode_tests.log" 2>&1
echo "rc=$?" >> "$OUT/gpu_decode_tests.log"
tail -n 15 "$OUT/gpu_decode_tests.log"
rm -rf "$PKG"
