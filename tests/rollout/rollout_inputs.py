# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Inputs the rollout tests share: seeded random prompts of given lengths, and a greedy generation config."""

from __future__ import annotations

import torch
from transformers import GenerationConfig


def random_prompts(model, lengths, seed: int = 1) -> list[list[int]]:
    """One prompt per length, token ids drawn from [4, vocab) (ids 0-3 are the tiny tokenizer's specials)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]


def greedy_config(**kw) -> GenerationConfig:
    """Greedy decoding, EOS id 1, pad id 0; keyword arguments override (e.g. ``max_new_tokens``, ``do_sample``)."""
    return GenerationConfig(**{"do_sample": False, "eos_token_id": [1], "pad_token_id": 0, **kw})
