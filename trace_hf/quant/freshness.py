# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""When packed FP4 expert weights are re-quantized from their BF16 masters: every freshness rule in one place.

The packed weights (what the rollout reads, and what the QAT forward dequantizes) must never be older than the
masters. Three triggers keep them fresh, each for updates the others cannot see:

1. an optimizer step, anywhere: a global step hook marks every live FP4 experts module stale (fused/foreach
   optimizer kernels may update in place without bumping version counters);
2. in-place edits: `TraceFP4Experts.packed_weights` compares the masters' version counters and storage, and in
   training a strided sample of their bits (``.data`` writes and weight syncs bump no counter);
3. a rollout: every eval forward that starts a sequence (a `generate` call, a prefill) re-quantizes, whatever
   changed the masters (`install_prefill_refresh`; the rollout engine refreshes itself and skips it with
   `no_prefill_refresh`).

An optimizer handed the packed buffers of frozen experts is refused here too: it would step nothing.
``TRACE_HF_DEBUG=1`` adds a full check of the masters at every reuse.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref

from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook


#: Every live FP4 experts module (`TraceFP4Experts` adds itself).
LIVE: weakref.WeakSet = weakref.WeakSet()
#: Full-tensor checks of the masters at every reuse of packed weights (a pass over them and a host sync).
DEBUG = os.environ.get("TRACE_HF_DEBUG", "0") not in ("", "0")
_CHECKED_OPTIMIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PREFILL_REFRESHED: weakref.WeakSet = weakref.WeakSet()  # models with the prefill hook installed
_SKIP_REFRESH = threading.local()


def _invalidate_after_step(optimizer, args, kwargs) -> None:
    for m in list(LIVE):
        m.invalidate_packed()


def _refuse_frozen_in_optimizer(optimizer, args, kwargs) -> None:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if _CHECKED_OPTIMIZERS.get(optimizer) == len(params):
        return
    frozen = {id(b) for m in list(LIVE) if m.frozen for b in m.buffers(recurse=False)}
    if any(id(p) in frozen for p in params):
        raise ValueError(
            "The optimizer holds packed weights of frozen FP4 experts (TraceFP4Config(freeze_experts=True)): they "
            "are fixed FP4 codes and scales with no gradient, and stepping them would do nothing. Hand the optimizer "
            "only trainable parameters, e.g. [p for p in model.parameters() if p.requires_grad]."
        )
    _CHECKED_OPTIMIZERS[optimizer] = len(params)


register_optimizer_step_post_hook(_invalidate_after_step)
register_optimizer_step_pre_hook(_refuse_frozen_in_optimizer)


def refresh_fp4_weights(model: nn.Module) -> None:
    """Re-quantize every FP4 experts module's packed weights from its masters, now.

    The triggers above cover optimizer steps, counted in-place edits, whole-tensor ``.data`` writes and every
    rollout. Call this after an edit the sample may miss (``p.data[e, i] = ...`` on a few elements) before a
    training forward."""
    for m in model.modules():
        if m in LIVE:
            m.refresh_packed()


@contextlib.contextmanager
def no_prefill_refresh():
    """Inside, eval forwards do not refresh the packed weights (a caller that just refreshed them, e.g. the rollout
    engine before its prefill)."""
    prev = getattr(_SKIP_REFRESH, "on", False)
    _SKIP_REFRESH.on = True
    try:
        yield
    finally:
        _SKIP_REFRESH.on = prev


def install_prefill_refresh(model: nn.Module) -> None:
    """Refresh the packed weights at every eval forward that starts a sequence (no cache, or an empty one): once per
    `generate` call, so no rollout ever runs on packed weights older than the masters, however they were changed."""

    def hook(module, args, kwargs):
        if module.training or getattr(_SKIP_REFRESH, "on", False):
            return None
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None or (hasattr(cache, "get_seq_length") and cache.get_seq_length() == 0):
            refresh_fp4_weights(module)
        return None

    if model not in _PREFILL_REFRESHED:
        model.register_forward_pre_hook(hook, with_kwargs=True)
        _PREFILL_REFRESHED.add(model)
