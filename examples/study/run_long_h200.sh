#!/usr/bin/env bash
# The long study in one device call: warm up once, then every (regime, seed) as its own process, all started at
# once and spread over the visible GPUs (several per GPU: the ~100M model leaves an H200 mostly idle), each
# stopping its training in time (study.py --max-train-seconds) to evaluate and write result.json; then the report.
#
#   OUT=outputs/study_long STEPS=200 BUDGET_S=580 SEEDS="0 1" bash examples/study/run_long_h200.sh
#
# BUDGET_S: seconds for the whole call. REGIMES (default below), EVAL_EVERY (25) and EVAL_PROBLEMS (256): the test
# accuracy curve. RESERVE_S (60): a run's start-up and final evaluations, kept outside its training budget.
# STUDY_ARGS: more study.py arguments for the warm-up and every run (e.g. "--size tiny" for a CPU check).
# Returns env.txt, table.md, summary.json, study.png, kl_vs_bytes.png, curves.png and study.tar.gz (results, logs).
set -u
source examples/study/common.sh
study_setup outputs/study_long
STEPS=${STEPS:-200}
SEEDS=${SEEDS:-0}
REGIMES=${REGIMES:-bf16 fp4_naive fp4_qat trace_replay all_sites_h100}
study_grid
export OMP_NUM_THREADS=$(( $(nproc) / JOBS > 0 ? $(nproc) / JOBS : 1 ))

echo "== 1. warm-up (GPU 0)"
study_warm 0 ${STUDY_ARGS:-}

TRAIN_S=$((DEADLINE - SECONDS - 40 - ${RESERVE_S:-60}))
echo "== 2. $JOBS runs on $NGPU GPU(s), $STEPS GRPO steps or $TRAIN_S s of training each"
study_grid_runs --steps "$STEPS" --eval-every "${EVAL_EVERY:-25}" --eval-problems "${EVAL_PROBLEMS:-256}" \
  --max-train-seconds "$TRAIN_S" ${STUDY_ARGS:-}

echo "== 3. report"
study_report
ls -la "$OUT"
rm -rf "$W"
