#!/usr/bin/env bash
# Device call h100_130 (one H100): Qwen3.5's 8-layer step, frozen FP4 + LoRA r=32, 64 x 1K, one step each (the same
# rollout), with the backward kernel's settings from h100_129's sweep (chunk 16, block_v 16, one warp): the kernel's
# gradient, the chunked gradient (--recurrent-chunk-gradient, the before), the kernel's again.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1; L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
Q="python -m benchmarks.training.grpo_step_qwen35 --layers 8 --freeze-experts --lora-r 32 --prompts 8 --completion 1024 --eos-mean 384 --steps 1 --setups engine_fp4"
timeout 80 $Q --out $OUT/q35_8_warmup.json >> $L 2>&1; echo "q35 warm-up rc=$?"
timeout 50 $Q --recurrent-chunk-gradient --out $OUT/q35_8_chunkgrad.json >> $L 2>&1; echo "q35 chunk gradient rc=$?"
timeout 50 $Q --out $OUT/q35_8.json >> $L 2>&1; echo "q35 rc=$?"
timeout 60 python -m pytest -q -m gpu tests/train/test_recurrent_rule_kernel.py -p no:cacheprovider > $OUT/pytest.txt 2>&1; echo "pytest rc=$?"; tail -1 $OUT/pytest.txt
grep '^STEP' $L | cut -c1-300
gzip $L
