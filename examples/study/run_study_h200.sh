#!/usr/bin/env bash
# The 500-step study with accuracy headroom (issue 34) in one call on ONE H200: SFT-warm the ~12M MoE on the chained
# word problems until its greedy test accuracy reaches TARGET (a warm start with headroom), then start the 15
# (regime, seed) GRPO runs at once on the GPU, each stopping its training in time to evaluate (FP4 and BF16
# inference) and write result.json; then the report (table.md with the pre-registered comparisons, plots).
#
#   OUT=outputs/study_500 BUDGET_S=450 bash examples/study/run_study_h200.sh
#
# BUDGET_S: seconds for the whole command. STEPS (500), SEEDS ("0 1 2"), REGIMES (the five below), LR (1e-4: GRPO's
# learning rate), WARMUP (0: its linear warm-up steps), TEMP (1.0: the rollout temperature), PROMPTS (8) x GENS (8)
# completions per step, TARGET (0.3), SFT_STEPS (3000), SFT_S (60: the warm-up's seconds at most), SFT_SCHEDULE (onecycle; anneal: the
# warm start ends at lr 0, see study.py --sft-schedule), SFT_EVAL_EVERY (100), EVAL_EVERY (50), EVAL_PROBLEMS (256),
# RESERVE_S (70: a run's start-up and final evaluations, kept outside its training budget). The third run's knobs
# (docs/results.md 6e): BETA (0: GRPO's KL coefficient to the warm start), MASTER_WEIGHTS (bf16; fp32: an FP32 master
# copy takes the optimizer's updates), AUX_COEF (the model's 0.001: TRL's router_aux_loss_coef), SFT_ANNEAL_STEPS (60)
# and BRANCH_FROM (0.05: SFT_SCHEDULE=branch, where the stop rule checks the accuracy after the decay). STUDY_ARGS: more
# study.py arguments for the warm-up and every run ("--size tiny" for a CPU check). The defaults are the first run's
# (docs/results.md 6b); the second run's settings are docs/results.md 6c's command, the third's 6e's. Returns env.txt, table.md,
# summary.json, study.png, kl_vs_bytes.png, curves.png and study.tar.gz (results, logs, the report again); FEW_FILES=1:
# table.md, summary.json, curves.png and study.tar.gz only. MPS (1): see below.
set -u
source examples/study/common.sh
study_setup outputs/study_500
STEPS=${STEPS:-500}
SEEDS=${SEEDS:-0 1 2}
REGIMES=${REGIMES:-bf16 fp4_naive fp4_qat trace_replay all_sites_replay}
TASK_ARGS="--task chain --size mini --max-completion-length 152 --eval-problems ${EVAL_PROBLEMS:-256} ${STUDY_ARGS:-}"
study_grid
export OMP_NUM_THREADS=1

study_mps

echo "== 1. warm-up: SFT until greedy test accuracy >= ${TARGET:-0.3} (at most ${SFT_S:-60} s)"
study_warm 0 $TASK_ARGS --sft-steps "${SFT_STEPS:-3000}" --sft-lr 1e-3 --sft-batch 256 --target-accuracy "${TARGET:-0.3}" \
  --sft-eval-every "${SFT_EVAL_EVERY:-100}" --max-sft-seconds "${SFT_S:-60}" --sft-schedule "${SFT_SCHEDULE:-onecycle}" \
  --sft-anneal-steps "${SFT_ANNEAL_STEPS:-60}" --branch-from "${BRANCH_FROM:-0.05}"
grep -E "greedy test accuracy|annealed over" "$W/study_warm.log"

TRAIN_S=$((DEADLINE - SECONDS - 40 - ${RESERVE_S:-70}))
TRAIN_UNTIL=$(($(date +%s) + TRAIN_S))  # one deadline for all runs; they end at one common step (EqualSteps)
echo "== 2. $JOBS runs on $NGPU GPU(s), $STEPS GRPO steps or until $TRAIN_S s from now, all at one common step"
study_grid_runs --steps "$STEPS" --eval-every "${EVAL_EVERY:-50}" --prompts-per-step "${PROMPTS:-8}" \
  --num-generations "${GENS:-8}" --learning-rate "${LR:-1e-4}" --warmup-steps "${WARMUP:-0}" \
  --temperature "${TEMP:-1.0}" --train-deadline "$TRAIN_UNTIL" --beta "${BETA:-0}" \
  --master-weights "${MASTER_WEIGHTS:-bf16}" ${AUX_COEF:+--router-aux-loss-coef "$AUX_COEF"} \
  --sync-dir "$W/study/sync" --sync-runs "$JOBS" $TASK_ARGS

echo "== 3. report"
study_report
ls -la "$OUT"
if [ "$MPS_ON" = 1 ]; then
  echo quit | nvidia-cuda-mps-control
  trap - EXIT
fi
rm -rf "$W"
