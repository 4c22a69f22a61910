#!/usr/bin/env bash
# Device call h100_120 (one 80 GB H100): Qwen3.5's 8-layer shape (frozen FP4 experts + LoRA r=32, 64 rows x 1K,
# packed) with gated_delta_rule chunk against recurrent on the SAME rollout: one warm-up process compiles every
# kernel, then one step of each rule from the same seed (step 1's rollout is identical across processes), so the
# training-side phases of the two compare token for token (h100_119's step-2 comparison had different rollouts).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
Q8="python -m benchmarks.training.grpo_step_qwen35 --layers 8 --freeze-experts --lora-r 32 --prompts 8 --completion 1024 --eos-mean 384 --steps 1 --setups engine_fp4"
timeout 70 $Q8 --gated-delta-rule recurrent --out $OUT/warmup.json >> $L 2>&1; echo "warm-up rc=$?"
timeout 50 $Q8 --gated-delta-rule chunk --out $OUT/q35_8_chunk.json >> $L 2>&1; echo "q35 8 chunk rc=$?"
timeout 50 $Q8 --gated-delta-rule recurrent --out $OUT/q35_8_recurrent.json >> $L 2>&1; echo "q35 8 recurrent rc=$?"
grep '^{"setup' $L | cut -c1-900
gzip $L
