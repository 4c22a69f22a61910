# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Kernel benchmarks: bandwidth and bit-exactness of the quantization kernels, launch-config sweeps, A/B runs of
launch settings inside the whole decode step, one call under Nsight Compute, and sm_90 instruction counts."""
