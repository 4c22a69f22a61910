#!/usr/bin/env bash
# Device call h100_121 (one 80 GB H100, commit de2ab95; no H200 could be started, so the BF16 run was skipped): the full 48-layer Qwen3-30B-A3B shape, frozen experts +
# LoRA r=32, 256 long-tailed rows x 1K, micro-batch 32, packed, fused norm + rotary, one process per run:
#   FP4 with PEFT's input casts removed (TraceGRPOConfig(disable_input_dtype_casting=True), the default; step 2
#   profiled, --profile train), FP4 with them kept (--keep-adapter-casts), and, where the card holds it (BF16 at 48
#   layers takes ~94 GiB: an H200), BF16 with the defaults (--profile train).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
B="python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --micro-batch 32 --steps 2"
timeout 175 $B --setups engine_fp4 --profile train --out $OUT/fp4_48.json >> $L 2>&1; echo "fp4 rc=$?"
timeout 165 $B --setups engine_fp4 --keep-adapter-casts --out $OUT/fp4_48_casts.json >> $L 2>&1; echo "fp4 casts rc=$?"
if [ "$MIB" -gt 100000 ]; then
  timeout 200 $B --setups engine_bf16 --profile train --out $OUT/bf16_48.json >> $L 2>&1; echo "bf16 rc=$?"
fi
grep '^STEP' $L | cut -c1-600
gzip $L
