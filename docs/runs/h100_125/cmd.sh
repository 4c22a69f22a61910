#!/usr/bin/env bash
# Device call h100_125 (one 80 GB H100): (1) the gpu tests of skip_scoring_forward and varlen attention;
# (2) the full 48-layer Qwen3-30B-A3B shape, frozen FP4 experts + LoRA r=32, 256 long-tailed rows x 1K, micro-batch
#     32, packed, unprofiled: the IS ratio and trace/* metrics from the training forwards (the default) against a
#     separate no-grad scoring forward (--scoring-forward), in both orders (skip, scoring, scoring, skip), one process
#     each; second steps compared per kept token.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
timeout 120 python -m pytest -q -m gpu tests/train/test_packed_forwards.py -p no:cacheprovider > $OUT/pytest.txt 2>&1; echo "pytest rc=$?"; tail -3 $OUT/pytest.txt
B="python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --micro-batch 32 --steps 2 --setups engine_fp4"
timeout 125 $B --out $OUT/skip_a.json >> $L 2>&1; echo "skip a rc=$?"
timeout 105 $B --scoring-forward --out $OUT/scoring_a.json >> $L 2>&1; echo "scoring a rc=$?"
timeout 105 $B --scoring-forward --out $OUT/scoring_b.json >> $L 2>&1; echo "scoring b rc=$?"
timeout 105 $B --out $OUT/skip_b.json >> $L 2>&1; echo "skip b rc=$?"
grep '^STEP' $L | cut -c1-330
gzip $L
