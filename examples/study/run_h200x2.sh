#!/usr/bin/env bash
# One call on a 2-GPU H200 machine: the multi-GPU check (issue 9) and the small-scale study (issue 8).
#
#   OUT=outputs/h200x2 bash examples/study/run_h200x2.sh
#
# 1. GPU1: examples/grpo.py (tiny default, its SFT warm-up) on one GPU, 20 steps; GPU0 meanwhile SFT-warms the
#    ~100M study model. 2. The same GRPO run with DDP on both GPUs (same global batch: 8 prompts per device),
#    started from the same warm weights. 3. The study regimes in three queues (GPU0 and GPU1; all on GPU0 when
#    the machine has one GPU, which skips 1 and 2: the small models leave the H200 mostly idle). 4. The report.
# Results are packed into $OUT/study.tar.gz and $OUT/ddp.tar.gz (the device returns at most 8 files).
set -u
source examples/study/common.sh
study_setup outputs/h200x2
STEPS=${STEPS:-30}

G1=1; [ "$NGPU" -lt 2 ] && G1=0  # one GPU: both queues share it, no DDP run
echo "== 1. one-GPU GRPO (GPU $G1) and the study warm-up (GPU0), in parallel"
[ "$G1" = 1 ] && (CUDA_VISIBLE_DEVICES=1 timeout 120 $PY examples/grpo.py --max_steps 20 --output_dir "$W/ddp/1gpu" \
  > "$W/ddp_1gpu.log" 2>&1; echo "rc=$?" >> "$W/ddp_1gpu.log") &
study_warm 0
wait

echo "== 2. the same GRPO run with DDP on two GPUs"
if [ "$G1" = 1 ]; then
  timeout 100 $PY -m accelerate.commands.launch --multi_gpu --num_processes 2 --mixed_precision no \
    examples/grpo.py --max_steps 20 --model_name_or_path "$W/ddp/1gpu/sft-warm" \
    --output_dir "$W/ddp/2gpu" \
    > "$W/ddp_2gpu.log" 2>&1
  echo "ddp rc=$?"
  grep -E "reward/|wall_time" "$W/ddp_1gpu.log" "$W/ddp_2gpu.log"
else
  echo "skipped: one GPU"
fi

echo "== 3. study regimes in three queues, spread over the GPUs ($STEPS GRPO steps each)"
run_queue() {
  local q=$1 gpu=$2
  shift 2
  for regime in "$@"; do
    study_grpo "$regime" 0 "$gpu" --steps "$STEPS" >> "$W/queue$q.log"
  done
}
run_queue 0 0 trace_replay fp4_qat &
run_queue 1 $G1 fp4_naive trace bf16 &
run_queue 2 $G1 trace_replay_h100 trace_replay_h25 &
wait
cat "$W"/queue*.log

echo "== 4. report"
study_report
[ "$G1" = 1 ] && tar -C "$W" -czf "$OUT/ddp.tar.gz" --exclude='*.safetensors' ddp ddp_1gpu.log ddp_2gpu.log
ls -la "$OUT"
rm -rf "$W"
