# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The benchmarks, by purpose: ``kernels`` (launch-config sweeps, A/B runs, Nsight Compute and sm_90 SASS counts),
``rollout`` (decode-step speed), ``training`` (QAT step, whole GRPO steps), ``mismatch`` (where rollout and training
disagree); ``harness`` is what they share. Run each as a module from the repository root, e.g.
``python -m benchmarks.rollout.rollout_decode --smoke --out /tmp/d.json`` (benchmarks/README.md lists them)."""
