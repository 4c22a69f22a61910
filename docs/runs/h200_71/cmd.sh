#!/usr/bin/env bash
# Device call h200_71 (one H200), issue 31: where the FP4 prefill waits on the host (h200_69: 45-61 ms of GPU idle
# per prefill, BF16 none): `prefill --sync-check` (host syncs by call site, allocator frees and retries); and an A/B of
# the 8-layer GRPO step (FP4 engine, long-tailed lengths) with the grouped prefill path on and off
# (`fp4_moe_configs.GROUPED = {}` set before the run) for trace/kl_rollout_train. From the root:
#   OUT=$OUT bash docs/runs/h200_71/cmd.sh
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/r; mkdir -p "$R"
timeout 100 python3 -m benchmarks.rollout.prefill --setups fp4 --cells 1x16384,16x1024 --repeats 2 --sync-check \
  --out "$R/prefill_sync.json" > "$R/prefill_sync.log" 2>&1
echo "rc=$? after $((SECONDS - START)) s" >> "$R/prefill_sync.log"; grep -E '^setup=|rc=' "$R/prefill_sync.log" | cut -c1-1500
G="--prompts 32 --completion 512 --eos-mean 192 --setups engine_fp4 --steps 3"
timeout 110 python3 -m benchmarks.training.grpo_step $G --out "$R/grpo_grouped.json" > "$R/grpo_grouped.log" 2>&1
echo "rc=$? after $((SECONDS - START)) s" >> "$R/grpo_grouped.log"
timeout 110 python3 -c "import runpy, sys; from trace_hf.kernels import fp4_moe_configs as c; c.GROUPED = {}; \
sys.argv = ['grpo_step'] + sys.argv[1:]; runpy.run_module('benchmarks.training.grpo_step', run_name='__main__')" \
  $G --out "$R/grpo_no_grouped.json" > "$R/grpo_no_grouped.log" 2>&1
echo "rc=$? after $((SECONDS - START)) s" >> "$R/grpo_no_grouped.log"
for f in grpo_grouped grpo_no_grouped; do
  echo "$f: $(grep -o "'trace/kl_rollout_train': '[^']*'" "$R/$f.log" | tr '\n' ' ') $(tail -n 1 "$R/$f.log")"
  grep -E '"rollout_tokens_per_s"' "$R/$f.log" | tail -n 1 | cut -c1-200
done
tar -czf "$OUT/h200_71.tar.gz" -C "$R" .
