#!/usr/bin/env bash
# Device call h200_129 (one H200, a fresh machine; branch token-counts-unspecialized at 2b60bde, before
# _decode_rows_kernel was added to it): devq/first.sh, which runs devq/tok.sh. Its pytest ran without -m gpu, so every
# cpu-parametrized kernel test failed (no interpreter on a GPU machine: expected), and it timed out at 170 s before its
# summary; h200_132 and h200_133 are those tests run properly. Then the 48-layer FP4 job, steps 1-3, under stall_log.
# devq/first.sh:
#   #!/usr/bin/env bash
#   # First call, any card: the GPU tests of the unspecialized-count fix, then 48-layer FP4 steps 1-3 (tok.sh).
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
#   nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
#   cp devq/commit.txt $OUT/; python -c "import torch,triton,transformers,trl;print(torch.__version__,triton.__version__,transformers.__version__,trl.__version__)" | tee $OUT/versions.txt
#   BUDGET=${BUDGET:-430} bash devq/tok.sh
# devq/tok.sh, as it ran:
#   # H100: the GPU tests of the kernels whose token counts are no longer specialized (the new compile test first), then
#   # the 48-layer FP4 job, steps 1-3, Triton misses and GC passes printed: do steps 2-3 still compile?
#   export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1; START=$SECONDS
#   timeout 200 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_token_counts.py tests/kernels/test_rms_norm.py tests/kernels/test_rope.py tests/kernels/test_fp4_kernels.py tests/train/test_recurrent_rule_kernel.py tests/quant/test_frozen_kernel_training.py tests/kernels/test_fp4_moe.py > $OUT/pytest_gpu.txt 2>&1
#   echo "pytest rc=$? at $((SECONDS-START))"; tail -4 $OUT/pytest_gpu.txt | cut -c1-400
#   R=$((${BUDGET:-370} - (SECONDS-START)))
#   [ $R -gt 120 ] && timeout $R python -m benchmarks.stall_log benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 3 --micro-batch 32 --setups engine_fp4 --out $OUT/fp4_48.json > $OUT/fp4_48.log 2>&1; echo "fp4 rc=$? at $((SECONDS-START))"
#   grep -E '^(STEP|GC)' $OUT/fp4_48.log | cut -c1-120; grep -E '^(STEP|JIT)' $OUT/fp4_48.log | awk '/^STEP/{s++} /^JIT/{print "after step", s, $3}' | sort | uniq -c
#   [ -f $OUT/fp4_48.json ] && python -c "
#   import json,os;r=json.load(open(os.environ['OUT']+'/fp4_48.json'))['results'][0];print(json.dumps(r.get('phases_all_steps')));print(json.dumps(r.get('phase_calls_last_step')))"
#   [ -f $OUT/fp4_48.log ] && gzip $OUT/fp4_48.log
BUDGET=430 bash devq/first.sh
