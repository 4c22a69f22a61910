# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Rollout benchmarks: the decode step of the engine (Qwen3-MoE, Qwen3.5) against stock `generate` and BF16."""
