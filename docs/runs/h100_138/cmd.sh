#!/usr/bin/env bash
# Device call h100_138 (one H100; asked as nvidia-h200 without needs_h200, an H100 came), commit 3637b14: devq/any.sh -> the H100 branch below.
# (1) Qwen3.5 40 layers, 256 long-tailed rows x 1K, frozen FP4 experts + LoRA r=32, micro-batch 32, one step each from the same seed
# (the same rollout) after an 8-layer warm-up process: the recurrent rule skipping packed rows' padding (the default), then stepping it
# (--rule-over-padding); (2) what the engine admits at 128K with the step records streamed to CPU memory.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log; START=$SECONDS
Q="--freeze-experts --lora-r 32 --completion 1024 --eos-mean 384 --micro-batch 32 --setups engine_fp4 --steps 1"
timeout 70 python -m benchmarks.training.grpo_step_qwen35 $Q --layers 8 --prompts 4 --out $OUT/warmup.json >> $L 2>&1
timeout 180 python -m benchmarks.training.grpo_step_qwen35 $Q --layers 40 --prompts 32 --out $OUT/q35_40_skip.json >> $L 2>&1
timeout 180 python -m benchmarks.training.grpo_step_qwen35 $Q --layers 40 --prompts 32 --rule-over-padding --out $OUT/q35_40_pad.json >> $L 2>&1
timeout 90 python -m benchmarks.rollout.decode_qwen35 --steps 10 --admit --setups fp4_triton --hint-storage cpu --cells 48x131072 --out $OUT/dec_cpu.json
gzip $L
