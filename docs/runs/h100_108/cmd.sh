#!/usr/bin/env bash
# Device call h100_108 (one 80 GB H100: "NVIDIA H100 80GB HBM3", commit 42acf89): the pre-registered BF16 study pilot of
# issue 54 (docs/results.md section 8) with COLLAPSE=1, in one call: the registered warm start (docs/runs/pilot_warm,
# carried in; sha256 1c4d44cc...909a) measured on the GPU, the BF16 GRPO pilot at lr 3e-5/1e-4/3e-4 x seeds 0 1 2, the
# gate, then (gate open) the regimes at the winning rate (the collapse test runs only when the gate is closed).
# Carried: .whl, docs/runs/pilot_warm/warm/model.safetensors. study.tar.gz (5.3 MB) is not kept: its per-run
# result.json files are in results/ (gzipped); warm.json (left out of the returned files) comes from it too.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; OUT=$OUT BUDGET_S=540 COLLAPSE=1 timeout 575 bash examples/study/run_pilot_h200.sh > $OUT/all.log 2>&1; tail -n 60 $OUT/all.log
