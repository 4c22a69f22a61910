#!/usr/bin/env bash
# Device call h200_86 (issue 31): the attention's spread decode (gpu/attn.sh) and the prefill's fp32-sum grouped
# GEMMs + one-launch KV load (gpu/prefill.sh), each script's own header says what it measures.
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 300 bash gpu/attn.sh; echo "attn rc=$? at $((SECONDS - START)) s"
timeout 250 bash gpu/prefill.sh; echo "prefill rc=$? at $((SECONDS - START)) s"
echo "total $((SECONDS - START)) s"
