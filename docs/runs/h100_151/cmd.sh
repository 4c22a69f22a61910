#!/usr/bin/env bash
# Device call h100_151 (one H100, a fresh machine; main 4aa1a68). Issue 53's 40-layer Qwen3.5-35B-A3B rollouts alone
# (`--rollout-only`, nothing trained): frozen experts + PEFT LoRA r=32 on every target the hybrid engine folds, 256
# long-tailed rows x 1K, each setup its own process: engine FP4 + TRACE (2 generation batches; the first compiles),
# engine BF16 (2 batches: does it fit 80 GB?), `generate` FP4 (1 batch: the same packed FP4 weights and adapters through
# `model.generate`, the path a Qwen3.5 LoRA run fell back to). No H200 came this session (five refused starts), so
# `generate` BF16 (~60 GiB of BF16 experts plus 256 rows of Gated DeltaNet state and KV cache) was not run.
# devq/q35h100.sh, as it ran (BUDGET=540):
#   #!/usr/bin/env bash
#   # H100: issue 53's 40-layer Qwen3.5-35B-A3B rollouts alone (frozen experts + LoRA r=32 folded, 256 x 1K long-tailed):
#   # engine FP4, engine BF16 (does it fit 80 GB?), generate FP4 (the engine against generate on the same weights).
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
#   nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt; cp devq/commit.txt $OUT/
#   export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; START=$SECONDS
#   B="python -m benchmarks.training.grpo_step_qwen35 --layers 40 --freeze-experts --lora-r 32 --prompts 32 --completion 1024 --eos-mean 384 --micro-batch 32 --rollout-only"
#   run() {  # setup steps seconds
#     R=$((${BUDGET:-560} - (SECONDS-START))); [ $R -gt 30 ] || return
#     T=$3; [ $T -lt $R ] || T=$R
#     timeout $T $B --steps $2 --setups $1 --out $OUT/q35_$1.json > $OUT/q35_$1.log 2>&1; echo "$1 rc=$? at $((SECONDS-START))"
#     grep -E "^ROLLOUT" $OUT/q35_$1.log | cut -c1-200; tail -2 $OUT/q35_$1.log | cut -c1-300
#   }
#   run engine_fp4 2 ${T1:-170}; run engine_bf16 2 ${T2:-170}; run generate_fp4 1 9999
#   gzip $OUT/*.log
BUDGET=540 bash devq/q35h100.sh
