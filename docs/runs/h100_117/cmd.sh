#!/usr/bin/env bash
# Device call h100_117 (one 80 GB H100, commit 5b9eb8f): the GPU tests (-m gpu; first GPU run of the recurrent Gated
# DeltaNet kernel and of the reworked frozen-expert backward), then the full 48-layer Qwen3-30B-A3B shape, frozen FP4
# experts + LoRA r=32, 256 long-tailed rows x 1K, micro-batch 32, packed, step 3 profiled (--profile train): the same
# command as h100_115, after the frozen backward's glue cut.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
timeout 290 python -m pytest -q -p no:cacheprovider -m gpu tests > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -n 15 $OUT/gpu_tests.log
B="python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 3 --micro-batch 32 --profile train"
timeout 250 $B --setups engine_fp4 --out $OUT/fp4_48.json >> $L 2>&1; echo "fp4 48 rc=$?"
grep '^{"setup' $L | cut -c1-1500
gzip $L
