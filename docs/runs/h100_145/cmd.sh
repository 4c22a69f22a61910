#!/usr/bin/env bash
# Device call h100_145 (one H100, a fresh machine; commit 166e57e): `BUDGET=400 bash devq/any.sh`, which on an H100
# ran the script below: the gpu tests of the engine waves and compaction (the fragments test in both allocator modes),
# then FP4 against BF16 at 24 layers of the 256 x 1K job, one process each; steps 2-3 are the measurement.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
# H100: the fragments test in both allocator modes (and the waves/compaction gpu tests); FP4 against BF16 at 24 layers
# of the 256 x 1K job (48 do not fit BF16 on an H100), each in its own process, step 3 (steps 1-2 compile).
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # what examples/grpo.py sets
L=$OUT/all.log; START=$SECONDS
timeout 80 python -m pytest -q -m gpu -p no:cacheprovider tests/rollout/test_engine_waves.py tests/rollout/test_engine_compaction.py > $OUT/pytest_gpu.txt 2>&1
echo "pytest rc=$? at $((SECONDS-START))"; tail -3 $OUT/pytest_gpu.txt | cut -c1-300
B="python -m benchmarks.training.grpo_step --layers 24 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 3 --micro-batch 32"
timeout 170 $B --setups engine_fp4 --out $OUT/fp4_24.json >> $L 2>&1; echo "fp4 rc=$? at $((SECONDS-START))"
R=$((${BUDGET:-400} - (SECONDS-START))); timeout $R $B --setups engine_bf16 --out $OUT/bf16_24.json >> $L 2>&1; echo "bf16 rc=$? at $((SECONDS-START))"
grep '^STEP' $L | cut -c1-200
gzip $L
