# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The importance-sampling correction for an FP4 sampler: the ratio of the trainer's to the sampler's probability.

A pure function of the two log-probs, so it can be read and tested alone; `TraceGRPOTrainer` applies it through
TRL's per-token advantages, with the same modes and bounds TRL uses for vLLM rollouts.
"""

from __future__ import annotations

import math

import torch


#: ``token_*``: one ratio per token; ``sequence_*``: one per sequence (the product over its tokens). ``*_truncate``
#: clamps ratios to [clip_min, clip_max]; ``*_mask`` zeroes those outside.
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_sampling_ratio(
    trainer_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_truncate",
    clip_min: float | None = None,
    clip_max: float | None = None,
) -> torch.Tensor:
    """exp(trainer logp - sampler logp) over the completion tokens in `mask`: [B, T] per token, [B, 1] per sequence.
    Tokens without a sampler log-prob (NaN) count as ratio 1."""
    if mode not in IS_MODES:
        raise ValueError(f"importance sampling mode {mode!r}: use one of {list(IS_MODES)}.")
    diff = torch.nan_to_num((trainer_logps - sampler_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
