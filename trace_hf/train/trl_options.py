# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""TRL `GRPOConfig` options that `TraceGRPOTrainer` cannot honour, refused when the config is built.

Every other GRPOConfig field that touches generation or the loss works with the trainer; `tests/train/test_trl_options.py`
runs each on the tiny model, and docs/api.md lists the outcomes. A refusal names the field, why, and what to do
instead, so that no option is silently ignored.
"""

from __future__ import annotations

from dataclasses import fields


#: Fields refused when set away from TRL's default: field -> (why, what to do instead).
REFUSED = {
    "use_transformers_paged": (
        "it switches generation to transformers' continuous batching, which records neither hints nor the sampler's "
        "log-probs",
        "leave it False; rollout_engine='engine' is the fast rollout path here",
    ),
    "use_liger_kernel": (
        "liger-kernel patches the model's norms, RoPE and MLP modules in place, which would change the rollout and "
        "training paths under the FP4 experts' hint and routing-replay hooks untested (and TRL deprecates it for "
        "Hub kernels)",
        "leave it False; the log-probs already come from TRL's chunked LM head, which never materialises the "
        "[B, T, V] logits",
    ),
}

# vLLM's settings (server, colocate, memory, ...) configure a generator this trainer never starts; the vLLM
# importance-sampling fields are checked by TraceGRPOConfig itself, which names their rollout_importance_sampling_*
# counterparts.
_VLLM_IS_PREFIX = "vllm_importance_sampling"


def changed_fields(config, names) -> list[str]:
    """The fields among `names` that `config` sets away from their dataclass defaults."""
    defaults = {f.name: f.default for f in fields(config)}
    return [n for n in names if n in defaults and getattr(config, n) != defaults[n]]


def check_trl_options(config) -> None:
    """Raise for a GRPOConfig option the TRACE trainer cannot honour (`REFUSED`, and every `vllm_*` setting)."""
    for name in changed_fields(config, REFUSED):
        why, instead = REFUSED[name]
        raise ValueError(
            f"TraceGRPOConfig({name}={getattr(config, name)!r}) is not supported: {why}. {instead[0].upper()}{instead[1:]}."
        )
    vllm = [f.name for f in fields(config) if f.name.startswith("vllm_") and not f.name.startswith(_VLLM_IS_PREFIX)]
    changed = changed_fields(config, vllm)
    if changed:
        raise ValueError(
            f"TraceGRPOConfig: {changed} configure vLLM, which TraceGRPOTrainer never uses (it rolls out through the "
            "model's own FP4 path, where the hints are recorded). Remove them; rollout_engine picks the rollout path "
            "('engine', 'generate' or 'auto')."
        )
