# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The training side's rotary embedding in one Triton launch each way (`TraceGRPOConfig.fused_rope`).

transformers' ``apply_rotary_pos_emb`` is about six elementwise launches per tensor forward and as many back.
transformers calls it as a function of the modeling module, with no per-module hook, so `fused_rope` rebinds it in
the model's modeling modules for the duration of a context (the trainer's forward and its backward, so checkpointed
recomputes see it too), as `delta_rule.recurrent_values` does for the Gated DeltaNet rule. The kernel
(`trace_hf.kernels.rope`) gives transformers' values bit for bit, forward and backward, so the rebinding changes
no number, only the launches; operands it does not take (fp16, other cos/sin layouts, CPU) go to transformers'
function.
"""

from __future__ import annotations

import contextlib
import sys

import torch


#: Modeling modules whose ``apply_rotary_pos_emb`` is ``x * cos + rotate_half(x) * sin`` on the first
#: ``cos.shape[-1]`` channels (the rest passed through), as `trace_hf.kernels.rope` computes it, and whether its
#: result is contiguous (partial rotary concatenates) rather than laid out as q.
MODULES = {
    f"transformers.models.{m}.modeling_{m}": m in ("qwen3_5_moe", "qwen3_next")
    for m in ("qwen3_moe", "qwen3_5_moe", "qwen3_next", "qwen2_moe", "mixtral", "olmoe")
}
_WRAPPERS: set = set()  # the rebound functions, so a nested context does not wrap them twice


def _use_kernel(q: torch.Tensor) -> bool:
    """The kernel runs CUDA tensors (a test on the interpreter patches this)."""
    return q.is_cuda


def _fused(original, contiguous: bool):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        from trace_hf.kernels.rope import rope, supported

        if (
            unsqueeze_dim == 1  # q and k [B, H, T, D], as the attention layers pass them
            and _use_kernel(q)
            and supported(q, cos)
            and supported(k, cos)
            and sin.shape == cos.shape
            and sin.dtype == cos.dtype
        ):
            return rope(q, cos, sin, contiguous), rope(k, cos, sin, contiguous)
        return original(q, k, cos, sin, unsqueeze_dim)

    _WRAPPERS.add(apply_rotary_pos_emb)
    return apply_rotary_pos_emb


def rope_modules(model: torch.nn.Module) -> list:
    """The modeling modules (Python modules) of ``model``'s layers whose rotary embedding `fused_rope` rebinds."""
    found = {type(m).__module__ for m in model.modules()} & MODULES.keys()
    return [sys.modules[name] for name in sorted(found) if hasattr(sys.modules[name], "apply_rotary_pos_emb")]


@contextlib.contextmanager
def fused_rope(model: torch.nn.Module):
    """Within the context, ``model``'s attention layers rotate q and k with `trace_hf.kernels.rope` on CUDA."""
    rebound = []
    for module in rope_modules(model):
        original = module.apply_rotary_pos_emb
        if original not in _WRAPPERS:
            module.apply_rotary_pos_emb = _fused(original, MODULES[module.__name__])
            rebound.append((module, original))
    try:
        yield
    finally:
        for module, original in rebound:
            _WRAPPERS.discard(module.apply_rotary_pos_emb)
            module.apply_rotary_pos_emb = original
