# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Training benchmarks: the QAT forward + backward, and whole GRPO steps of `TraceGRPOTrainer`."""
