#!/usr/bin/env bash
# Device call h100_126 (an H100 came; the script picks by card: gpu.txt). (1) The gpu tests of the packed training forwards
# (skip_scoring_forward in bf16 on CUDA, varlen flash attention). (2) The full 48-layer Qwen3-30B-A3B shape, frozen
# experts + LoRA r=32, 256 long-tailed rows x 1K, micro-batch 32, packed, unprofiled, one process each, step 2 the
# measurement: FP4 with the scoring forward skipped (the default), FP4 with a separate no-grad scoring forward
# (--scoring-forward, the before), then on an H200 BF16 (~94 GiB, does not fit an H100), on an H100 the default again
# (the reverse order).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
timeout 90 python -m pytest -q -m gpu tests/train/test_packed_forwards.py -p no:cacheprovider > $OUT/pytest.txt 2>&1; echo "pytest rc=$?"; tail -3 $OUT/pytest.txt
B="python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 2 --micro-batch 32"
timeout 150 $B --setups engine_fp4 --out $OUT/fp4_48.json >> $L 2>&1; echo "fp4 rc=$?"
timeout 105 $B --setups engine_fp4 --scoring-forward --out $OUT/fp4_48_scoring.json >> $L 2>&1; echo "fp4 scoring rc=$?"
if [ "$MIB" -gt 100000 ]; then
  timeout 200 $B --setups engine_bf16 --out $OUT/bf16_48.json >> $L 2>&1; echo "bf16 rc=$?"
else
  timeout 105 $B --setups engine_fp4 --out $OUT/fp4_48_again.json >> $L 2>&1; echo "fp4 again rc=$?"
fi
grep '^STEP' $L | cut -c1-330
gzip $L
