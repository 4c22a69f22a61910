#!/usr/bin/env bash
# Device call h100_130 (H100 or H200, gpu.txt names it): (1) Qwen3.5-35B-A3B's 40-layer GRPO step, frozen FP4 + LoRA
# r=32 on every target the engine folds, 256 x 1K long-tailed, micro-batch 32, packed, the scoring forward skipped (the
# defaults; issue 53); (2) the 8-layer full fine-tune (QAT) step, 256 x 512 long-tailed, micro-batch 32, packed against
# TRL's padded micro-batches (issue 51's QAT path); (3) Qwen3.5's 40-layer FP4 decode at 128K with the rows the engine
# admits (--admit) beside 32 rows.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
timeout 250 python -m benchmarks.training.grpo_step_qwen35 --layers 40 --freeze-experts --lora-r 32 --prompts 32 \
    --completion 1024 --eos-mean 384 --micro-batch 32 --steps 2 --setups engine_fp4 --out $OUT/q35_40_fp4.json >> $L 2>&1
echo "q35 rc=$?"
Q="python -m benchmarks.training.grpo_step --layers 8 --prompts 32 --completion 512 --eos-mean 192 --micro-batch 32 --steps 2 --setups engine_fp4"
timeout 80 $Q --out $OUT/qat8_packed.json >> $L 2>&1; echo "qat packed rc=$?"
timeout 80 $Q --token-budget 0 --out $OUT/qat8_padded.json >> $L 2>&1; echo "qat padded rc=$?"
timeout 90 python -m benchmarks.rollout.decode_qwen35 --setups fp4_triton --steps 10 --admit --cells 32x131072 \
    --out $OUT/decode_128k.json >> $L 2>&1; echo "decode rc=$?"; grep '^{' $L | cut -c1-300
grep '^STEP' $L | cut -c1-330
gzip $L
