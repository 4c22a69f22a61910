#!/usr/bin/env bash
# One device call on the H200, in parts (PARTS, default all, in this order): `tests` (the GPU-marked tests of
# TEST_FILES, default all, with -v and a per-test timeout),
# `tune` (the FP4 MoE launch-config sweep, extra arguments in TUNE_ARGS), `attn` (the FP4 decode attention
# sweep, ATTN_ARGS), `train` (the QAT train-step benchmark), `decode` (the rollout-decode benchmark, extra
# arguments in ROLLOUT_ARGS), `grpo` (whole GRPO steps with generate / the engine, benchmarks/training/grpo_step.py, extra
# arguments in GRPO_ARGS). Everything goes under $OUT (default outputs/h200). Each part has a timeout, so
# a hang in one part does not lose the others. Run it from the repository root: the benchmarks run as modules
# (`python -m benchmarks.kernels.fp4_moe_tune`), so the root's trace_hf (with kernels/ bound beside it) is the one
# they import.
#
#   PARTS="tests tune train" bash benchmarks/h200_run.sh
#   PARTS=decode ROLLOUT_BUDGET_S=190 bash benchmarks/h200_run.sh
#
# No pip install needed for trace_hf: the tests get it on PYTHONPATH with kernels/ linked in as trace_hf/kernels
# (what the editable install's package-dir mapping does), so this runs on the machine's own python3 and packages
# (the GPU test of the hints also needs TRL: install the wheels of ../shared/device/wheels.sh first).
set -u
ROOT=$(pwd)
OUT=${OUT:-outputs/h200}
PARTS=${PARTS:-tests tune attn train decode grpo}
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
  git -C "$ROOT" log -1 --format=%h 2>/dev/null
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
has() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }
# bench NAME TIMEOUT_S LINES MODULE [ARGS]: `python -m MODULE --out $OUT/NAME.json ARGS` under a timeout, its output
# and then its exit code (rc=) in $OUT/NAME.log; shows the log's last LINES lines.
bench() {
  local name=$1 limit=$2 lines=$3 module=$4
  shift 4
  timeout "$limit" $PY -m "$module" --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$?" >> "$OUT/$name.log"
  tail -n "$lines" "$OUT/$name.log"
}

if has tests; then
  echo "== GPU tests"
  # From $PKG, so that `python -m pytest` (which puts the working directory first on sys.path) finds the
  # trace_hf with kernels/ linked in. pytest's `pythonpath` (pyproject.toml) then puts the root first, for the
  # tests that import `benchmarks`: its trace_hf binds the kernels/ beside it, the same code.
  # TEST_FILES: test file names (found in tests/'s subject folders; default: the whole tests/ tree, -m gpu).
  # -v names every test's outcome as it ends, so a run that TESTS_BUDGET_S cuts short still says what passed and
  # what failed; pytest-timeout ends a single test after TEST_TIMEOUT_S and the run goes on.
  FILES="$ROOT/tests"
  if [ -n "${TEST_FILES:-}" ]; then
    FILES=""
    for f in $TEST_FILES; do
      FILES="$FILES $(ls "$ROOT"/tests/*/"$f")"
    done
  fi
  (cd "$PKG" && timeout ${TESTS_BUDGET_S:-150} $PY -m pytest -v -s -m gpu -p no:cacheprovider --rootdir="$ROOT" \
    --timeout ${TEST_TIMEOUT_S:-90} $FILES) > "$OUT/gpu_tests.log" 2>&1
  echo "rc=$?" >> "$OUT/gpu_tests.log"
  grep -E "PASSED|FAILED|ERROR|Timeout|^rc=" "$OUT/gpu_tests.log" | sed "s|$ROOT/||" | cut -c1-200 | tail -n 80
fi

if has tune; then
  echo "== FP4 MoE launch-config sweep"
  bench fp4_moe_tune $((${TUNE_BUDGET_S:-150} + 60)) 8 benchmarks.kernels.fp4_moe_tune --budget-s ${TUNE_BUDGET_S:-150} \
    ${TUNE_ARGS:-}
fi

if has attn; then
  echo "== FP4 decode attention launch-config sweep"
  bench fp4_attention_tune $((${ATTN_BUDGET_S:-150} + 90)) 6 benchmarks.kernels.fp4_attention_tune \
    --budget-s ${ATTN_BUDGET_S:-150} ${ATTN_ARGS:-}
fi

if has train; then
  echo "== train step benchmark"
  bench train_step 150 3 benchmarks.training.train_step
fi

if has decode; then
  echo "== rollout decode benchmark"
  bench rollout_decode $((${ROLLOUT_BUDGET_S:-250} + 60)) 25 benchmarks.rollout.rollout_decode \
    --budget-s ${ROLLOUT_BUDGET_S:-250} ${ROLLOUT_ARGS:-}
fi
if has grpo; then
  echo "== GRPO step benchmark"
  # GRPO_WRAP: a runner module and its arguments put before the benchmark (e.g. benchmarks.kernels.with_hopper_block_t 16)
  timeout ${GRPO_BUDGET_S:-420} $PY -m ${GRPO_WRAP:-} benchmarks.training.grpo_step --out "$OUT/grpo_step${GRPO_TAG:-}.json" ${GRPO_ARGS:-} \
    > "$OUT/grpo_step${GRPO_TAG:-}.log" 2>&1
  echo "rc=$?" >> "$OUT/grpo_step${GRPO_TAG:-}.log"
  grep -E '^\{"setup"|rc=|Error' "$OUT/grpo_step${GRPO_TAG:-}.log" | tail -n 12
fi
rm -rf "$PKG"
