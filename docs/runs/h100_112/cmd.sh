#!/usr/bin/env bash
# Device call h100_112 (one 80 GB H100, fresh machine; the working tree at 06bd45f, after the lighter replay hook and
# the Guide's row counts of d91aa86): the GPU tests of the hints, training and quantization folders, the ones that run
# use_hints, routing replay and the frozen experts on CUDA. 6 passed. (The log's first line, `git log -1`, names the
# device copy's stale git metadata, not the tree that ran: the device copies the working tree's files.)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
timeout 170 python -m pytest -q -p no:cacheprovider -m gpu tests/hints tests/train tests/quant >> $OUT/gpu_tests_hook.log 2>&1
