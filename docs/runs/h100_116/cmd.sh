#!/usr/bin/env bash
# Device call h100_116 (one 80 GB H100; the tree of commit after 68974a3 with Qwen3.5 packed by default and its
# scoring forwards' budget counted as rows x longest): the 40-layer Qwen3.5-35B-A3B shape, frozen FP4 experts + LoRA
# r=32, 256 long-tailed rows x 1K, micro-batch 32, the default token_budget, with flash-linear-attention 0.6.0
# installed (.whl_fla: fla's Triton chunked gated delta rule in training forwards, as a user would run it; without
# it transformers falls back to its torch rule). Step 2 is the measurement.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl_fla/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
Q40="python -m benchmarks.training.grpo_step_qwen35 --layers 40 --freeze-experts --lora-r 32 --prompts 32 --completion 1024 --eos-mean 384 --micro-batch 32 --steps 2"
timeout 235 $Q40 --setups engine_fp4 --out $OUT/q35_40_fp4_fla.json >> $L 2>&1; echo "q35 40 fp4 fla rc=$?"
grep -E '^(\{"setup|STEP)' $L | cut -c1-700
grep -c "flash-linear-attention. is not installed" $L
gzip $L
