# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""What the rollout tests share: seeded random prompts of given lengths, a greedy generation config, and the check
that two engine rollouts gave the same rows."""

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


def assert_same_rollout(a, b, record: bool) -> None:
    """Two `RolloutOutput`s with the same completions and log-probs and, with ``record``, the same `HintBatch` bit
    for bit (every field, and the experts_hidden and kv sites' hints)."""
    assert a.completion_ids == b.completion_ids
    assert a.logprobs == b.logprobs
    if record:
        ha, hb = a.hints, b.hints
        for name in ("lengths", "token_ids", "mantissa_bits", "block_scale", "global_scale", "routing"):
            x, y = getattr(ha, name), getattr(hb, name)
            assert x.shape == y.shape and torch.equal(x, y), name
        assert ha.sites == hb.sites and set(ha.site_hints) == {"experts_hidden", "kv"}
        for site in ha.site_hints:
            for x, y in zip(ha.site_hints[site], hb.site_hints[site], strict=True):
                assert x.shape == y.shape and torch.equal(x, y), site
