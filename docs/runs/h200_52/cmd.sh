#!/usr/bin/env bash
# Device call h200_52 (one H200): the GPU tests of the whole tree (-m gpu) beside the Qwen3.5 mismatch measurement,
# then the 8-layer GRPO step with long-tailed completion lengths (issue 31's grpo goal). Everything comes back as
# one tarball (the device returns at most 8 files). Run from the repository root:
#   OUT=$OUT bash docs/runs/h200_52/cmd.sh
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
(OUT=$R/tests PARTS=tests TESTS_BUDGET_S=${TESTS_BUDGET_S:-210} bash benchmarks/h200_run.sh > "$R/tests.out" 2>&1) &
TESTS=$!
# flash-linear-attention (pure-python wheels in .whl/fla) only for this process: its backward refuses Triton 3.6.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla .whl/fla/*.whl
PYTHONPATH=/tmp/site:/tmp/fla:$PWD timeout 150 python3 -m benchmarks.mismatch.qwen35_mismatch --device cuda --shape small \
  --warm-steps 200 --warm-pairs 5 --lr 1e-3 --rows 32 --new 96 --budget-s 80 --out "$R/qwen35_mismatch.json" \
  > "$R/qwen35_mismatch.log" 2>&1
echo "q35 rc=$?" >> "$R/qwen35_mismatch.log"
wait $TESTS
tail -n 5 "$R/tests/gpu_tests.log"
timeout ${GRPO_S:-170} python3 -m benchmarks.training.grpo_step --prompts 32 --completion 512 --eos-mean 192 \
  --setups engine_bf16,engine_fp4 --steps 3 --out "$R/grpo_step_longtail.json" > "$R/grpo_step_longtail.log" 2>&1
echo "grpo rc=$?" >> "$R/grpo_step_longtail.log"
tail -n 25 "$R/grpo_step_longtail.log"
tail -n 15 "$R/qwen35_mismatch.log"
tar -czf "$OUT/h200_52.tar.gz" -C "$R" .
