#!/usr/bin/env bash
# Device call h100_150 (one H100, a fresh machine; commit bf54b35): the full 48-layer FP4 job, steps 1-3 of one process,
# twice: with every Python GC pass over 20 ms and every Triton specialization miss printed (benchmarks/stall_log.py,
# run then as devq/jit_count.py, before it was committed), then the same with the
# heap frozen (gc.freeze()) before Trainer.train (GC_FREEZE=1). Per-call times of step 3 in each JSON.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
B="python -m benchmarks.stall_log benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 3 --micro-batch 32 --setups engine_fp4"
for v in 0 1; do
  GC_FREEZE=$v timeout 250 $B --out $OUT/fp4_48_gc$v.json > $OUT/fp4_48_gc$v.log 2>&1
  gzip $OUT/fp4_48_gc$v.log
done
