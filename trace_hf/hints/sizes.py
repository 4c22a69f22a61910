# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Hint bytes per token from a model config alone."""

from __future__ import annotations

import functools

from .. import fp4
from ..models import default_hint_layers, full_attention_layers, head_dim, moe_layer_indices
from ..quant.config import HINT_SITES


def hint_bytes_per_token_by_site(
    config, fmt: str = "nvfp4", hint_layers: int | None = None, sites=("experts_input",)
) -> dict[str, int]:
    """Hint bytes one token costs at each site, from a model config alone (no weights): W/8 mantissa bytes, W/block
    scale bytes and a 4-byte row scale (NVFP4) per row of width W. Per hinted MoE layer a token has one
    experts_input row (hidden_size), top_k experts_hidden rows (moe_intermediate_size) and, where the decoder layer
    has full attention, 2 * num_key_value_heads kv rows (head_dim)."""
    bad = [s for s in sites if s not in HINT_SITES]
    if bad or isinstance(sites, str):
        raise ValueError(f"hint_bytes_per_token: unknown sites {bad or sites!r}; give a list of {list(HINT_SITES)}.")
    text = config.get_text_config(decoder=True)
    moe = moe_layer_indices(config)
    n = default_hint_layers(len(moe)) if hint_layers is None else hint_layers
    hinted = moe[len(moe) - n :] if n else []
    row = functools.partial(fp4.hint_bytes_per_row, fmt=fmt)
    out = {}
    for site in (s for s in HINT_SITES if s in sites):
        if site == "experts_input":
            out[site] = n * row(text.hidden_size)
        elif site == "experts_hidden":
            out[site] = n * text.num_experts_per_tok * row(text.moe_intermediate_size)
        else:
            full = set(full_attention_layers(config))
            out[site] = sum(i in full for i in hinted) * 2 * text.num_key_value_heads * row(head_dim(config))
    return out


def hint_bytes_per_token(config, fmt: str = "nvfp4", hint_layers: int | None = None, sites=("experts_input",)) -> int:
    """Hint bytes one token costs for a model config over `sites` (`hint_bytes_per_token_by_site`): per hinted layer
    H/8 mantissa bytes, H/block scale bytes and a 4-byte row scale (NVFP4) for the default experts_input."""
    return sum(hint_bytes_per_token_by_site(config, fmt, hint_layers, sites).values())
