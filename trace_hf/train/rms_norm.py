# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The training side's RMSNorms in one Triton launch each way (`TraceGRPOConfig.fused_rms_norm`).

transformers' RMSNorm is about seven launches forward and a dozen back over fp32 copies; `FusedRMSNorm` takes a
known RMSNorm's place (same ``weight`` parameter, so checkpoints, PEFT and the rollout engine see the same model) and
runs `trace_hf.kernels.rms_norm` on CUDA. Elsewhere it computes transformers' ops in transformers' order, so CPU
values are transformers' bit for bit; on CUDA they are up to the fp32 order of the row's sum of squares.
"""

from __future__ import annotations

import torch
from torch import nn


#: transformers' RMSNorm classes by weight form: ``weight * x̂.to(dtype)`` ...
SCALED_AFTER_CAST = frozenset(
    {"Qwen3MoeRMSNorm", "Qwen2MoeRMSNorm", "MixtralRMSNorm", "OlmoeRMSNorm", "DeepseekV3RMSNorm", "Glm4MoeRMSNorm",
     "Ernie4_5_MoeRMSNorm", "Qwen3RMSNorm", "LlamaRMSNorm"}
)  # fmt: skip
#: ... and ``(x̂ * (1 + weight.float())).to(dtype)``, the weight stored centred on 0.
ZERO_CENTERED = frozenset({"Qwen3_5MoeRMSNorm", "Qwen3NextRMSNorm"})
_HOOK_DICTS = tuple(name for name in vars(nn.Module()) if "_hook" in name)


def _use_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel runs CUDA tensors of the dtypes it rounds for (a benchmark on the interpreter patches this)."""
    from trace_hf.kernels.common import ROUNDED_DTYPES

    return x.is_cuda and x.dtype in ROUNDED_DTYPES and weight.dtype in ROUNDED_DTYPES


class FusedRMSNorm(nn.Module):
    """An RMSNorm of either weight form, one Triton launch each way on CUDA (bf16 or fp32), transformers' ops elsewhere."""

    def __init__(self, weight: nn.Parameter, eps: float, zero_centered: bool):
        super().__init__()
        self.weight = weight
        self.eps = eps
        self.zero_centered = zero_centered

    @classmethod
    def replacing(cls, norm: nn.Module) -> FusedRMSNorm | None:
        """The fused module for one of transformers' RMSNorms, or None for a class of another form."""
        name = type(norm).__name__
        if name not in SCALED_AFTER_CAST | ZERO_CENTERED:
            return None
        eps = norm.eps if hasattr(norm, "eps") else norm.variance_epsilon
        fused = cls(norm.weight, eps, name in ZERO_CENTERED)
        # Hooks registered on the norm (PEFT, a user's, a test's) stay registered: the same dicts, so handles still remove them.
        for attr in _HOOK_DICTS:
            setattr(fused, attr, getattr(norm, attr))
        fused.train(norm.training)
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _use_kernel(x, self.weight):
            from trace_hf.kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, self.zero_centered)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' ops for this form, in their order."""
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (h * (1.0 + self.weight.float())).type_as(x)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, zero_centered={self.zero_centered}"


def fuse_rms_norms(model: nn.Module) -> int:
    """Put a `FusedRMSNorm` in place of each of ``model``'s known RMSNorms; returns how many. Gated norms (Qwen3.5's
    Gated DeltaNet) and unknown classes keep transformers' module."""
    swaps = [(name, FusedRMSNorm.replacing(m)) for name, m in model.named_modules()]
    swaps = [(name, fused) for name, fused in swaps if fused is not None]
    for name, fused in swaps:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, fused)
    return len(swaps)
