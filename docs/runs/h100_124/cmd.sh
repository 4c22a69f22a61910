#!/usr/bin/env bash
# Device call h100_124 (one 80 GB H100, the tree of commit 3538edd: TraceGRPOConfig.skip_scoring_forward):
# (1) the full 48-layer Qwen3-30B-A3B shape, frozen FP4 experts + LoRA r=32, 256 long-tailed rows x 1K, micro-batch
#     32, packed: the IS ratio and trace/* metrics from the training forwards (skip_scoring_forward=True, the default;
#     step 2 profiled, --profile train) against a separate no-grad scoring forward (--scoring-forward), one process each;
# (2) Qwen3.5-35B-A3B at its full 40 layers (frozen FP4 experts + LoRA r=32, 64 rows x 1K, packed), gated_delta_rule
#     chunk against recurrent on the SAME rollout: an 8-layer warm-up process compiles the kernels, then one step of
#     each rule from the same seed (step 1's rollout is identical across processes).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
B="python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --micro-batch 32 --steps 2 --setups engine_fp4"
timeout 170 $B --profile train --out $OUT/fp4_48.json >> $L 2>&1; echo "fp4 skip rc=$?"
timeout 100 $B --scoring-forward --out $OUT/fp4_48_scoring.json >> $L 2>&1; echo "fp4 scoring rc=$?"
Q="python -m benchmarks.training.grpo_step_qwen35 --freeze-experts --lora-r 32 --prompts 8 --completion 1024 --eos-mean 384 --steps 1 --setups engine_fp4"
timeout 60 $Q --layers 8 --prompts 2 --out $OUT/warmup.json >> $L 2>&1; echo "q35 warm-up rc=$?"
timeout 80 $Q --layers 40 --gated-delta-rule chunk --out $OUT/q35_40_chunk.json >> $L 2>&1; echo "q35 40 chunk rc=$?"
timeout 80 $Q --layers 40 --gated-delta-rule recurrent --out $OUT/q35_40_recurrent.json >> $L 2>&1; echo "q35 40 recurrent rc=$?"
grep '^STEP' $L | cut -c1-420
gzip $L
