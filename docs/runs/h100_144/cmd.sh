#!/usr/bin/env bash
# Device call h100_144 (one H100, a fresh machine; main 4968494 with the quarter-octave row buckets of branch
# quarter-octave-buckets): `bash devq/any.sh`, which on an H100 ran the script below. The first process compiled the
# kernels (its step 2 forward still compiled new shapes: 9.0 s against 4.6 s in the next process), so the A/B reads
# the rollout, which the buckets change. The fragments test failed under expandable segments (fixed in the next commit).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
# H100: the bucket change's GPU tests; the 48-layer 256 x 1K job with quarter-octave buckets (the default) against
# --coarse-buckets (the before), step 2 of each process, unprofiled; then --profile-host (fixed summary) at mb32.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # what examples/grpo.py sets
L=$OUT/all.log; START=$SECONDS
timeout 80 python -m pytest -q -m gpu -p no:cacheprovider tests/rollout/test_engine_waves.py tests/rollout/test_engine_compaction.py > $OUT/pytest_gpu.txt 2>&1
echo "pytest rc=$? at $((SECONDS-START))"; tail -3 $OUT/pytest_gpu.txt | cut -c1-300
B="python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --setups engine_fp4 --steps 2 --eos-mean 384 --completion 1024 --prompts 32 --micro-batch 32"
timeout 190 $B --out $OUT/fine.json >> $L 2>&1; echo "fine rc=$? at $((SECONDS-START))"
timeout 130 $B --coarse-buckets --out $OUT/coarse.json >> $L 2>&1; echo "coarse rc=$? at $((SECONDS-START))"
R=$((${BUDGET:-575} - (SECONDS-START))); timeout $R $B --profile-host --out $OUT/host.json >> $L 2>&1; echo "host rc=$? at $((SECONDS-START))"
grep '^STEP' $L | cut -c1-330
gzip $L
