#!/usr/bin/env bash
# docs/results.md section 8 (issue 54) in ONE device call on one GPU (H100 or H200): the BF16 pilot, its registered
# gate, and only if the gate opens, the regimes.
#
#   OUT=$OUT BUDGET_S=540 bash examples/study/run_pilot_h200.sh
#
# 1. The registered warm start (WARM_FROM, default docs/runs/pilot_warm: weights and warm.json, warmed and measured on
#    the CPU before the registration) is copied in and measured again on this GPU (`pilot.py measure`: greedy pass@1 in
#    BF16 and FP4, pass@8): the device's BF16 value is the gate's baseline.
# 2. The pilot: BF16 GRPO (`study.py grpo --regime bf16`) at every learning rate of LRS x every seed of SEEDS, all at
#    once under MPS, STEPS steps or until PILOT_S seconds from their launch, all ending at one common step (EqualSteps).
# 3. The gate (`pilot.py gate`, docs/results.md 8): a learning rate opens it when BF16 GRPO's final greedy test pass@1
#    (BF16 inference, 256 problems) is >= +0.10 above the warm start's, mean over seeds, and more than 2 SE; the
#    winner is the largest mean gain among those. Closed: the call ends here (COLLAPSE=1: the registered collapse test
#    runs instead, at the pilot's stable edge, see step 4b).
# 4. Gate open: REGIMES x SEEDS at the winning learning rate, all at once under MPS, STEPS steps or what the budget
#    holds, all at one common step; each final policy evaluated in BF16 and FP4 (for bf16: PTQ); the report.
# 4b. Gate closed and COLLAPSE=1: the same REGIMES x SEEDS at the collapse test's learning rate (`pilot.py gate`'s
#    `edge_learning_rate`), then the report with each run's steps-to-collapse (`pilot.py collapse`).
#
# BUDGET_S: seconds for the whole call (540: the device command's limit is 560). LRS ("3e-5 1e-4 3e-4"), SEEDS
# ("0 1 2"), STEPS (500), PILOT_S (170: the pilot's launch to its training deadline; its final evaluations come after),
# RESERVE_S (50: a run's final evaluations, kept outside its training budget), EVAL_EVERY (50), MPS (1).
# Everything comes back under $OUT: env.txt, warm.json, gate.json, pilot.md (the pilot's per-rate tables), and when
# the regimes ran table.md, summary.json, curves.png; study.tar.gz holds every run's result.json, the logs, the rest.
set -u
source examples/study/common.sh
study_setup outputs/pilot
WARM_FROM=${WARM_FROM:-docs/runs/pilot_warm}
LRS=${LRS:-3e-5 1e-4 3e-4}
SEEDS=${SEEDS:-0 1 2}
STEPS=${STEPS:-500}
REGIMES=${REGIMES:-bf16 fp4_naive fp4_qat trace_replay all_sites_replay}
read -ra LR_LIST <<< "$LRS"
read -ra SEED_LIST <<< "$SEEDS"
read -ra REGIME_LIST <<< "$REGIMES"
# The registered GRPO settings (docs/results.md 8), identical for the pilot and every regime.
TASK_ARGS="--task carry --size pilot --max-completion-length 96 --eval-problems 256"
GRPO_ARGS="--steps $STEPS --eval-every ${EVAL_EVERY:-50} --prompts-per-step 8 --num-generations 8 --temperature 0.7 \
--warmup-steps 20 --beta 0 --master-weights fp32 --router-aux-loss-coef 0 $TASK_ARGS"
export OMP_NUM_THREADS=1

study_mps

# grpo_runs DIR LR NAME [regimes...]: every (regime, seed) as its own `study.py grpo --out DIR`, all started at once,
# meeting at one common step (EqualSteps over DIR/sync) before the Unix time $TRAIN_UNTIL; each killed 40 s (the
# report's) before the call's deadline; waits for them all.
grpo_runs() {
  local dir=$1 lr=$2 name=$3 regime seed
  shift 3
  local n=$(($# * ${#SEED_LIST[@]})) left=$((DEADLINE - SECONDS - 40))
  if [ "$left" -lt 60 ]; then
    echo "$name: SKIPPED (out of time)"
    return
  fi
  for seed in "${SEED_LIST[@]}"; do
    for regime in "$@"; do
      (
        CUDA_VISIBLE_DEVICES=0 timeout "$left" $PY examples/study/study.py grpo --out "$dir" --regime "$regime" \
          --seed "$seed" --learning-rate "$lr" --train-deadline "$TRAIN_UNTIL" --sync-dir "$SYNC" --sync-runs "$N_SYNC" \
          --sync-name "${name}_${regime}_seed${seed}" \
          $GRPO_ARGS > "$W/${name}_${regime}_seed${seed}.log" 2>&1
        echo "$name $regime seed $seed rc=$? $(tail -n 1 "$W/${name}_${regime}_seed${seed}.log" | cut -c1-300)"
      ) &
    done
  done
  wait
}

# study_dir DIR: a study folder holding the warm start (the measured warm.json, the weights linked).
study_dir() {
  mkdir -p "$1"
  ln -sfn "$W/warm0/warm" "$1/warm"
  cp "$W/warm0/warm.json" "$1/warm.json"
}

# The registered weights are not in git (a checkpoint); the device call carries them, and they must be those registered.
WARM_SHA=1c4d44cc30adc41f2fd7276319eb23f613ca387ea4d1bbf7d540ec18ca53909a
if [ "$WARM_FROM" = docs/runs/pilot_warm ] && ! echo "$WARM_SHA  $WARM_FROM/warm/model.safetensors" | sha256sum -c --quiet -; then
  echo "The registered warm start $WARM_FROM/warm/model.safetensors is missing or differs (sha256 $WARM_SHA):" \
    "carry it into the device call (docs/results.md 8)." >&2
  exit 2
fi
echo "== 1. the registered warm start ($WARM_FROM), measured on this GPU"
mkdir -p "$W/warm0"
cp -r "$WARM_FROM/warm" "$W/warm0/warm"
cp "$WARM_FROM/warm.json" "$W/warm0/warm.json"
timeout 120 $PY examples/study/pilot.py measure --out "$W/warm0" > "$W/measure.log" 2>&1
echo "measure rc=$?"
tail -n 1 "$W/measure.log"
cp "$W/warm0/warm.json" "$OUT/warm.json"

echo "== 2. the pilot: BF16 GRPO at lr ${LR_LIST[*]} x seeds ${SEED_LIST[*]}, $STEPS steps or ${PILOT_S:-170} s"
TRAIN_UNTIL=$(($(date +%s) + ${PILOT_S:-170}))
SYNC=$W/pilot_sync N_SYNC=$((${#LR_LIST[@]} * ${#SEED_LIST[@]}))
GATE_ARGS=()
for lr in "${LR_LIST[@]}"; do
  study_dir "$W/pilot/lr$lr"
  GATE_ARGS+=(--out "$W/pilot/lr$lr")
  grpo_runs "$W/pilot/lr$lr" "$lr" "pilot_lr$lr" bf16 &
done
wait
for lr in "${LR_LIST[@]}"; do
  echo "### lr $lr" >> "$W/pilot.md"
  $PY examples/study/study.py report --out "$W/pilot/lr$lr" > /dev/null 2>&1 && cat "$W/pilot/lr$lr/table.md" >> "$W/pilot.md"
done
cp "$W/pilot.md" "$OUT/pilot.md"

echo "== 3. the gate"
$PY examples/study/pilot.py gate "${GATE_ARGS[@]}" --gate-json "$OUT/gate.json"
GATE_RC=$?
LR=$($PY -c "import json; g = json.load(open('$OUT/gate.json')); print(g['learning_rate'] if g['open'] else g['edge_learning_rate'] or '')" 2> /dev/null)

STAGE=""
if [ "$GATE_RC" = 0 ] && [ -n "$LR" ]; then
  STAGE=regimes
elif [ "${COLLAPSE:-0}" = 1 ] && [ -n "$LR" ]; then
  STAGE=collapse
fi
if [ -n "$STAGE" ]; then
  echo "== 4. $STAGE: ${REGIME_LIST[*]} x seeds ${SEED_LIST[*]} at lr $LR, $STEPS steps or what the budget holds"
  study_dir "$W/study"
  TRAIN_UNTIL=$(($(date +%s) + DEADLINE - SECONDS - 40 - ${RESERVE_S:-50}))
  SYNC=$W/study_sync N_SYNC=$((${#REGIME_LIST[@]} * ${#SEED_LIST[@]}))
  grpo_runs "$W/study" "$LR" "$STAGE" "${REGIME_LIST[@]}"
  echo "== 5. report"
  $PY examples/study/study.py report --out "$W/study" 2>&1 | tail -n 40
  cp "$W"/study/table.md "$W"/study/summary.json "$W"/study/curves.png "$OUT/" 2>/dev/null
  if [ "$STAGE" = collapse ]; then
    $PY examples/study/pilot.py collapse --out "$W/study" | tee "$OUT/collapse.md"
  fi
else
  echo "== gate closed: no regimes run (COLLAPSE=1 runs the registered collapse test)"
fi
cp "$OUT/env.txt" "$W/env.txt"
tar -C "$W" -czf "$OUT/study.tar.gz" --exclude='*.safetensors' --exclude='mps*' --exclude='pkg' .
ls -la "$OUT"
if [ "$MPS_ON" = 1 ]; then
  echo quit | nvidia-cuda-mps-control
  trap - EXIT
fi
rm -rf "$W"
