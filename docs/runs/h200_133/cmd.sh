#!/usr/bin/env bash
# Device call h200_133 (the same warm H200; the branch with _decode_rows_kernel unspecialized, committed next as
# 7f95f8f): the GPU tests of every kernel whose counts are unspecialized. devq/toktests.sh:
#   #!/usr/bin/env bash
#   # GPU tests of the unspecialized-count kernels: the gpu-marked tests of the files whose tests carry a cpu parameter,
#   # all of test_fp4_kernels (its `device` fixture is cuda on a GPU machine).
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
#   nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt; cp devq/commit.txt $OUT/; START=$SECONDS
#   timeout 200 python -m pytest -q -rfE -m gpu -p no:cacheprovider tests/kernels/test_token_counts.py tests/kernels/test_rms_norm.py tests/kernels/test_rope.py tests/train/test_recurrent_rule_kernel.py tests/quant/test_frozen_kernel_training.py tests/kernels/test_fp4_moe.py > $OUT/pytest_gpu_marked.txt 2>&1
#   echo "marked rc=$? at $((SECONDS-START))"; tail -4 $OUT/pytest_gpu_marked.txt | cut -c1-400
#   timeout 150 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_fp4_kernels.py > $OUT/pytest_fp4_kernels.txt 2>&1
#   echo "fp4_kernels rc=$? at $((SECONDS-START))"; tail -4 $OUT/pytest_fp4_kernels.txt | cut -c1-400
bash devq/toktests.sh
