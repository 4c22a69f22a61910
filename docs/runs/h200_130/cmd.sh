#!/usr/bin/env bash
# Device call h200_130 (the same warm H200 as h200_129, the same commit): the 48-layer BF16 job with the arguments
# of h200_129s FP4 job, steps 1-3, under stall_log. devq/bf16.sh:
#   #!/usr/bin/env bash
#   # H200, second call on the warm machine of first.sh: the 48-layer BF16 job with the same arguments as tok.sh's FP4.
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
#   nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt; cp devq/commit.txt $OUT/
#   export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1; START=$SECONDS
#   timeout ${BUDGET:-540} python -m benchmarks.stall_log benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 3 --micro-batch 32 --setups engine_bf16 --out $OUT/bf16_48.json > $OUT/bf16_48.log 2>&1; echo "bf16 rc=$? at $((SECONDS-START))"
#   grep -E '^(STEP|GC)' $OUT/bf16_48.log | cut -c1-160; grep -E '^(STEP|JIT)' $OUT/bf16_48.log | awk '/^STEP/{s++} /^JIT/{print "after step", s, $3}' | sort | uniq -c
#   [ -f $OUT/bf16_48.json ] && python -c "
#   import json,os;r=json.load(open(os.environ['OUT']+'/bf16_48.json'))['results'][0];print(json.dumps(r.get('phases_all_steps')));print(json.dumps(r.get('phase_calls_last_step')))"
#   gzip $OUT/bf16_48.log
BUDGET=500 bash devq/bf16.sh
