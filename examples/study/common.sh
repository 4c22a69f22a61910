# Shared by the study's device scripts (sourced from the repository root): the setup, the warm-up, one GRPO run,
# a grid of (regime, seed) runs at once, and the report. The device keeps nothing between calls, so every call warms
# up again and returns only what study_report leaves in $OUT (the device returns at most 8 files).

# study_setup DEFAULT_OUT: absolute $OUT, scratch $W, $PY, $DEADLINE (from BUDGET_S, the whole call's seconds),
# $NGPU, env.txt; trace_hf from this tree first on PYTHONPATH with kernels/ linked in as trace_hf/kernels (what the
# strict editable install maps), so the code under test is this checkout's, not an installed wheel's.
study_setup() {
  OUT=${OUT:-$1}
  mkdir -p "$OUT"
  OUT=$(cd "$OUT" && pwd)
  W=$(mktemp -d)
  mkdir -p "$W/pkg"
  cp -r trace_hf "$W/pkg/trace_hf"
  rm -rf "$W/pkg/trace_hf/kernels"
  ln -s "$(pwd)/kernels" "$W/pkg/trace_hf/kernels"
  export PYTHONPATH="$W/pkg${PYTHONPATH:+:$PYTHONPATH}"
  PY=${PY:-python3}
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
  DEADLINE=$((SECONDS + ${BUDGET_S:-540}))  # runs that cannot finish before this are skipped, and say so
  NGPU=$(nvidia-smi -L | wc -l)
  nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUT/env.txt"
  $PY -c "import torch, trl, transformers; print(torch.__version__, trl.__version__, transformers.__version__)" \
    >> "$OUT/env.txt"
  cat "$OUT/env.txt"
}

# study_mps: MPS (MPS=1, the default), so that many small runs' kernels share the GPU's multiprocessors instead of
# taking turns in time slices. Private pipe and log folders (only this command's processes connect), used only if a
# CUDA check passes under it, stopped when the command exits; MPS=0, a missing nvidia-cuda-mps-control or a failed
# check run without it. The GPU's settings (compute mode, clocks) are not touched. Sets $MPS_ON.
study_mps() {
  MPS_ON=0
  export PATH=$PATH:/usr/local/nvidia/bin
  if [ "${MPS:-1}" = 1 ] && command -v nvidia-cuda-mps-control > /dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=$W/mps CUDA_MPS_LOG_DIRECTORY=$W/mps_log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d && timeout 90 $PY -c "import torch; x = torch.ones(64, 64, device='cuda'); print('MPS check', (x @ x).sum().item())"; then
      MPS_ON=1
      trap 'echo quit | nvidia-cuda-mps-control' EXIT
    else
      echo quit | nvidia-cuda-mps-control
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    fi
  fi
  echo "MPS: $MPS_ON" | tee -a "$OUT/env.txt"
}

# study_warm GPU [study.py args]: the SFT warm-up into $W/study/warm.
study_warm() {
  local gpu=$1
  shift
  CUDA_VISIBLE_DEVICES=$gpu timeout 170 $PY examples/study/study.py warm --out "$W/study" "$@" \
    > "$W/study_warm.log" 2>&1
  echo "warm rc=$?"
  tail -n 3 "$W/study_warm.log"
}

# study_grpo REGIME SEED GPU [study.py grpo args]: one run, killed 40 s (the report's) before the deadline;
# skipped, and said so, when less than 60 s would be left.
study_grpo() {
  local regime=$1 seed=$2 gpu=$3
  shift 3
  local left=$((DEADLINE - SECONDS - 40)) log="$W/study_${regime}_seed${seed}.log"
  if [ "$left" -lt 60 ]; then
    echo "$regime seed $seed SKIPPED (out of time)"
    return
  fi
  CUDA_VISIBLE_DEVICES=$gpu timeout "$left" $PY examples/study/study.py grpo --out "$W/study" --regime "$regime" \
    --seed "$seed" "$@" > "$log" 2>&1
  echo "$regime seed $seed rc=$?"
  tail -n 1 "$log"
}

# study_grid: SEED_LIST and REGIME_LIST from $SEEDS and $REGIMES (space-separated), and JOBS, the runs they make.
study_grid() {
  read -ra SEED_LIST <<< "$SEEDS"
  read -ra REGIME_LIST <<< "$REGIMES"
  JOBS=$((${#SEED_LIST[@]} * ${#REGIME_LIST[@]}))
}

# study_grid_runs [study.py grpo args]: every (regime, seed) of study_grid as its own study_grpo, all started at once
# and spread round-robin over the $NGPU GPUs, run i's output in $W/queue$i.log; waits for them, then prints the logs.
study_grid_runs() {
  local i=0 seed regime
  for seed in "${SEED_LIST[@]}"; do
    for regime in "${REGIME_LIST[@]}"; do
      study_grpo "$regime" "$seed" $((i % NGPU)) "$@" > "$W/queue$i.log" &
      i=$((i + 1))
    done
  done
  wait
  cat "$W"/queue*.log
}

# study_report: the report's table, summary and plots into $OUT; results, logs (no weights), env.txt and the report
# again in study.tar.gz. FEW_FILES=1 leaves only table.md, summary.json, curves.png and study.tar.gz in $OUT (the
# device returns at most 8 files per call, and the call may carry other work's files too).
study_report() {
  $PY examples/study/study.py report --out "$W/study" 2>&1 | tail -n 20
  cp "$W"/study/table.md "$W"/study/summary.json "$W"/study/*.png "$OUT/" 2>/dev/null
  cp "$OUT/env.txt" "$W/study/env.txt"
  tar -C "$W" -czf "$OUT/study.tar.gz" --exclude='*/warm/*.safetensors' study $(cd "$W" && ls study_*.log queue*.log 2>/dev/null)
  if [ "${FEW_FILES:-0}" = 1 ]; then
    (cd "$OUT" && rm -f env.txt study.png kl_vs_bytes.png)
  fi
}
