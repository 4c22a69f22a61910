# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Rollouts: one seam (`RolloutOutput`), two paths (`GenerateRollout`, `EngineRollout`).

from trace_hf.rollout import make_rollout
rollout = make_rollout(model, "auto")                  # the engine on CUDA when it supports the model
out = rollout(model.eval(), prompt_ids, generation_config, record=True)
out.completion_ids, out.logprobs, out.hints            # hints: a HintBatch for use_hints / the trainer
"""

from __future__ import annotations

import logging

from .base import RolloutOutput
from .engine import EngineRollout, unsupported_reason
from .generate import GenerateRollout
from .sampling import SamplingSettings


logger = logging.getLogger(__name__)

ROLLOUT_ENGINES = ("auto", "engine", "generate")


def make_rollout(model, rollout_engine: str = "auto", generation_config=None, **engine_kwargs):
    """The rollout path for ``model``: ``"engine"`` (raises if the engine cannot run this model or these sampling
    settings), ``"generate"``, or ``"auto"`` (the engine on CUDA for a supported model, else generate, saying why
    in one log line). ``engine_kwargs`` go to `EngineRollout` (``max_rows``, ``free_memory_fraction``, ...)."""
    if rollout_engine not in ROLLOUT_ENGINES:
        raise ValueError(f"rollout_engine={rollout_engine!r}: use one of {list(ROLLOUT_ENGINES)}.")
    if rollout_engine == "generate":
        return GenerateRollout()
    reason = unsupported_reason(model, require_cuda=rollout_engine == "auto")
    if reason is None and generation_config is not None:
        try:
            SamplingSettings.from_generation_config(generation_config)
        except ValueError as e:
            reason = str(e)
    if reason is None:
        return EngineRollout(**engine_kwargs)
    if rollout_engine == "engine":
        raise ValueError(
            f"rollout_engine='engine' cannot roll out this model: {reason}. Use rollout_engine='generate'."
        )
    logger.warning("rollout_engine='auto': rolling out with model.generate because %s.", reason)
    return GenerateRollout()


__all__ = [
    "RolloutOutput",
    "GenerateRollout",
    "EngineRollout",
    "SamplingSettings",
    "make_rollout",
    "unsupported_reason",
    "ROLLOUT_ENGINES",
]
