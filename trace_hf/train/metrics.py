# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The `trace/*` metrics: named sums reduced over processes in one collective, then logged as ratios.

Why sums and counts: a rate averaged per process (a mean of means) weights a process with few tokens like one with
many; summing numerators and denominators over processes first gives the token-weighted rate.
"""

from __future__ import annotations

import torch


def reduce_sums(accelerator, sums: dict[str, float | torch.Tensor]) -> dict[str, float]:
    """Sum each named value over processes (one all-reduce for all of them); returns plain floats by name."""
    names = list(sums)
    device = accelerator.device
    t = torch.stack([torch.as_tensor(sums[n], dtype=torch.float64, device=device).reshape(()) for n in names])
    return dict(zip(names, accelerator.reduce(t, reduction="sum").tolist(), strict=True))


def log_ratio(metrics, key: str, num: float, den: float) -> None:
    """Log num / den under `key`, or nothing when den is 0: a rate over nothing would claim an agreement that was
    never checked."""
    if den:
        metrics[key].append(num / den)
