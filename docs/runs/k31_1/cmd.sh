# Device call 1 of issue 31's kernel part (run from the worktree root on the H200; trace_hf on PYTHONPATH).
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/env.txt 2>&1
timeout 95 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp4_moe_wgmma.py tests/test_fp4_moe_hopper.py tests/test_fp4_moe.py > $OUT/gpu_tests.log 2>&1; echo "rc=$?" >> $OUT/gpu_tests.log
tail -5 $OUT/gpu_tests.log
timeout 70 python3 benchmarks/fp4_moe_tune.py --wgmma --batches 256,512 --budget-s 45 --out $OUT/tune_decode.json 2>&1 | grep -v Warn | tee $OUT/tune.log
timeout 80 python3 benchmarks/fp4_moe_tune.py --wgmma --batches 2048,16384 --copies 1 --budget-s 55 --out $OUT/tune_prefill.json 2>&1 | grep -v Warn | tee -a $OUT/tune.log
timeout 100 python3 benchmarks/rollout_decode.py --setups fast_bf16,fast_fp4 --batches 256,512 --contexts 1024 --budget-s 80 --out $OUT/rollout_decode.json 2>&1 | tail -8 | tee $OUT/rollout_decode.log
