# Device call 2 of issue 31's kernel part (run from the worktree root on the H200; trace_hf on PYTHONPATH).
# Ran at commit 1a8b6d2, whose fp4_moe_tune.py still had --wg-stages / --wg-block-k-down (removed after this run).
# Everything printed goes to $OUT/run.log; at most 8 files come back.
export PYTHONUNBUFFERED=1
exec > >(tee $OUT/run.log) 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
echo "== GPU tests"
timeout 75 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp4_moe_wgmma.py tests/test_fp4_moe_hopper.py tests/test_fp4_moe.py > $OUT/gpu_tests.log 2>&1; echo "rc=$?" >> $OUT/gpu_tests.log
tail -4 $OUT/gpu_tests.log
echo "== decode step, 48 layers, 1K context"
timeout 85 python3 benchmarks/rollout_decode.py --setups fast_bf16,fast_fp4 --batches 1,64,128,256,512 --contexts 1024 --budget-s 70 --out $OUT/rollout_decode.json 2>&1 | grep -v "^setup="
echo "== expert layer sweep, decode"
timeout 50 python3 benchmarks/fp4_moe_tune.py --wgmma --batches 256,512 --wg-block-t 16,32,64 --wg-block-n 64 --wg-warps 4 --wg-stages 0,3,4 --wg-block-k-down 128,256 --budget-s 38 --out $OUT/tune_decode.json 2>&1 | grep -v Warn | tee $OUT/tune.log
echo "== expert layer sweep, prefill"
timeout 32 python3 benchmarks/fp4_moe_tune.py --wgmma --batches 2048,16384 --copies 1 --wg-block-t 64 --wg-block-n 64,128 --wg-warps 4 --wg-stages 0,3 --wg-block-k-down 128,256 --budget-s 20 --out $OUT/tune_prefill.json 2>&1 | grep -v Warn | tee -a $OUT/tune.log
mkdir -p /tmp/ab
echo "== A/B in the decode step: the weight ring"
AB_ARGS="--setups fast_fp4 --batches 256,512 --contexts 1024" VARIANTS='{"ring3": {"WGMMA*": {"stages": 3}}}' OUT=/tmp/ab timeout 60 python3 benchmarks/hopper_ab.py 2>&1 | grep -E "^(base|ring3)" | sed 's/\[(8.*)\] \[/[/' ; cp /tmp/ab/hopper_ab.json $OUT/ 2>/dev/null
echo "== kernel profile, batch 512"
timeout 30 python3 benchmarks/rollout_decode.py --setups fast_bf16,fast_fp4 --batches 512 --contexts 1024 --profile --steps 10 --budget-s 20 --out $OUT/profile.json 2>&1 | grep -v "^setup=" | tail -40
