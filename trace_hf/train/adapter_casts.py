# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""PEFT LoRA adapters fed their input as it is under autocast (`TraceGRPOConfig.disable_input_dtype_casting`).

PEFT keeps LoRA adapters in fp32 by default (``get_peft_model(..., autocast_adapter_dtype=True)``, which TRL uses)
and casts each adapter's input to that dtype before ``lora_A``. Under autocast (``bf16=True``: accelerate wraps every
training-side forward in it) ``lora_A`` is an autocast-listed linear, so autocast casts that fp32 copy straight back
to bf16, and backward undoes both casts again: per adapter four [tokens, in_features] copies a forward and its
backward, for no value changed. Skipping PEFT's cast (PEFT's own switch, ``cast_input_dtype_enabled``, which
`peft.helpers.disable_input_dtype_casting` sets on every adapter) gives the same bits wherever the cast round-trips
exactly: a plain LoRA adapter (no DoRA or other variant), without dropout (dropout would scale the fp32 copy, then
round), whose dtype is fp32 or the input's own. `autocast_adapter_inputs` sets it on those adapters only.
"""

from __future__ import annotations

import contextlib

import torch


def uncastable_adapters(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The PEFT LoRA linears of ``model`` whose input cast autocast undoes exactly (see the module docstring)."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # no PEFT, no adapters
        return []
    found = []
    for m in model.modules():
        if not isinstance(m, LoraLinear) or getattr(m, "lora_variant", {}) or m.merged:
            continue
        adapters = [a for a in m.active_adapters if a in m.lora_A]
        if adapters and all(
            isinstance(m.lora_dropout[a], torch.nn.Identity)
            and m.lora_A[a].weight.dtype in (torch.float32, m.get_base_layer().weight.dtype)
            for a in adapters
        ):
            found.append(m)
    return found


@contextlib.contextmanager
def autocast_adapter_inputs(adapters: list[torch.nn.Module]):
    """Inside the block, ``adapters`` (`uncastable_adapters`) take their input as it is. Only for forwards under
    autocast (and their backward): without it an fp32 adapter would get a bf16 input and its matmul would fail."""
    saved = [getattr(m, "cast_input_dtype_enabled", True) for m in adapters]
    for m in adapters:
        m.cast_input_dtype_enabled = False
    try:
        yield
    finally:
        for m, value in zip(adapters, saved, strict=True):
            m.cast_input_dtype_enabled = value
