#!/usr/bin/env bash
# Device call h200_54 (one H200), after the merges of fz30 (frozen experts train through the rollout's kernels),
# e31 (live-row compaction) and the lead's Qwen3.5 changes: the GPU tests of the whole tree (-m gpu) and the CUDA run
# of the Triton delta-rule test, the 8-layer GRPO step with long-tailed lengths (issue 31's goal, compaction on), and
# the 40-layer Qwen3.5 decode with each setup's best batch at 32K (issue 32). One tarball comes back. From the root:
#   OUT=$OUT bash docs/runs/h200_54/cmd.sh
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
OUT=$R/tests PARTS=tests TESTS_BUDGET_S=${TESTS_BUDGET_S:-200} bash benchmarks/h200_run.sh > "$R/tests.out" 2>&1
tail -n 4 "$R/tests/gpu_tests.log"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/rollout/test_qwen35_engine.py -k "triton_delta_rule" \
  > "$R/delta_rule_cuda.log" 2>&1; echo "rc=$?" >> "$R/delta_rule_cuda.log"; tail -n 2 "$R/delta_rule_cuda.log"
timeout ${GRPO_S:-170} python3 -m benchmarks.training.grpo_step --prompts 32 --completion 512 --eos-mean 192 \
  --setups engine_bf16,engine_fp4 --steps 3 --out "$R/grpo_step_longtail.json" > "$R/grpo_step_longtail.log" 2>&1
echo "grpo rc=$?" >> "$R/grpo_step_longtail.log"
tail -n 12 "$R/grpo_step_longtail.log"
timeout ${Q35_S:-150} python3 -m benchmarks.rollout.decode_qwen35 --setups bf16,bf16_triton,fp4,fp4_triton \
  --cells 64x1024,64x32768,96x32768,128x32768,256x32768,384x32768 --out "$R/decode_qwen35.json" \
  > "$R/decode_qwen35.log" 2>&1
echo "q35 rc=$?" >> "$R/decode_qwen35.log"
tail -n 3 "$R/decode_qwen35.log"
tar -czf "$OUT/h200_54.tar.gz" -C "$R" .
