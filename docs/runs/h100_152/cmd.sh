#!/usr/bin/env bash
# Device call h100_152 (the same warm H100 as h100_151, the next call; main 4aa1a68): the token-count GPU test, then the
# 48-layer Qwen3-30B-A3B FP4 job (frozen experts + LoRA r=32, 256 x 1K long-tailed, micro-batch 32 packed), steps
# 1-3 under benchmarks.stall_log, every Triton compile printed with its launch options. Step 2's one compile is
# `_fp4_kernel[num_warps=2, ...]`: the fake quantizer's large-call tile (lab-notes 35), as deduced without a device.
# devq/h100fix.sh, as it ran (BUDGET=390):
#   #!/usr/bin/env bash
#   # H100: the token-count test, then the 48-layer FP4 job, steps 1-3 under stall_log (whole variants printed): with
#   # every count unspecialized, do steps 2-3 compile anything, and which argument's specialization if so?
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
#   nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt; cp devq/commit.txt $OUT/
#   export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1; START=$SECONDS
#   timeout 60 python -m pytest -q -rfE -m gpu -p no:cacheprovider tests/kernels/test_token_counts.py > $OUT/pytest_gpu.txt 2>&1; echo "pytest rc=$? at $((SECONDS-START))"; tail -2 $OUT/pytest_gpu.txt
#   R=$((${BUDGET:-300} - (SECONDS-START)))
#   timeout $R python -m benchmarks.stall_log benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 3 --micro-batch 32 --setups engine_fp4 --out $OUT/fp4_48.json > $OUT/fp4_48.log 2>&1; echo "fp4 rc=$? at $((SECONDS-START))"
#   grep -E '^STEP' $OUT/fp4_48.log | cut -c1-100; grep -E '^STEP' $OUT/fp4_48.log | grep -o '"triton_compiles": {[^}]*}'
#   awk '/^STEP/{s++} /^JIT/ && s>=1 {print "after step", s, $0}' $OUT/fp4_48.log | cut -c1-3000
#   gzip $OUT/fp4_48.log
BUDGET=390 bash devq/h100fix.sh
