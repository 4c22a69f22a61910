#!/usr/bin/env bash
# Device call h100_129 (H100 or H200, gpu.txt names it): (1) the gpu tests of this session's changes: the recurrent
# delta rule's forward and backward kernels, the frozen experts' kernel training path (the checkpointed recompute that
# stops before experts last in their block), the packed training forwards (fp32 packed attention on CUDA), the Qwen3.5
# engine, the engine's waves and admission, compaction through the finer buckets; (2) the 48-layer Qwen3-30B-A3B job,
# frozen FP4 + LoRA r=32, 256 x 1K, micro-batch 32: the experts' saved tensors kept (the default) against
# --recompute-experts (the before); (3) Qwen3.5's 8-layer step, frozen FP4 + LoRA r=32, 64 x 1K, one step each (the same rollout): a
# warm-up, the recurrent values with the chunked gradient (--recurrent-chunk-gradient, the before), with the backward kernel (the default).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
timeout 150 python -m pytest -q -m gpu tests/train/test_recurrent_rule_kernel.py tests/quant/test_frozen_kernel_training.py \
    tests/train/test_packed_forwards.py tests/rollout/test_qwen35_engine.py tests/rollout/test_engine_waves.py \
    tests/rollout/test_engine_compaction.py -p no:cacheprovider > $OUT/pytest.txt 2>&1; echo "pytest rc=$?"
grep -E 'passed|failed|error' $OUT/pytest.txt | tail -5
B="python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 --completion 1024 --prompts 32 --steps 2 --micro-batch 32"
timeout 120 $B --setups engine_fp4 --recompute-experts --out $OUT/fp4_48_recompute.json >> $L 2>&1; echo "fp4 recompute rc=$?"
timeout 110 $B --setups engine_fp4 --out $OUT/fp4_48.json >> $L 2>&1; echo "fp4 rc=$?"
Q="python -m benchmarks.training.grpo_step_qwen35 --layers 8 --freeze-experts --lora-r 32 --prompts 8 --completion 1024 --eos-mean 384 --steps 1 --setups engine_fp4"
timeout 70 $Q --out $OUT/q35_8_warmup.json >> $L 2>&1; echo "q35 warm-up rc=$?"
timeout 50 $Q --recurrent-chunk-gradient --out $OUT/q35_8_chunkgrad.json >> $L 2>&1; echo "q35 chunk gradient rc=$?"
timeout 50 $Q --out $OUT/q35_8.json >> $L 2>&1; echo "q35 rc=$?"
grep '^STEP' $L | cut -c1-330
gzip $L
# The same warm H100, the next call: the recurrent rule's backward kernel by its settings (gdr_bwd.json; the settings
# as committed then were chunk 32, block_v 16, four warps):
#   python -m benchmarks.kernels.gated_delta_backward --rows 8 --out $OUT/gdr_bwd.json
