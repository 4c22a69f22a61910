# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""FP4 routed experts: one module with a QAT path (train) and a packed-FP4 rollout path (eval).

The module keeps the fused 3-D parameters of transformers' experts (`gate_up_proj` [E, 2I, H] and `down_proj`
[E, H, I]) under the same names, so a BF16 checkpoint loads with no conversion and the parameters stay the
trainable BF16 masters. Both paths quantize through `trace_hf.fp4`:

* expert weights: NVFP4/MXFP4 with one global scale per expert (`scale="expert"`), quantized once per
  optimizer step: packed for rollout, dequantized (cached) for the QAT forward;
* experts' input and hidden activation: one global scale per row (token), so a token's quantization does not
  depend on what else is in the batch;

which is what makes the rollout (eval) and the training forward compute the same function. The module computes
with its own token-grouped loop over hit experts (FP4 needs a quantization between the gate/up and the down
projection, which transformers' `ExpertsInterface` kernels have no place for), so the model's
`experts_implementation` setting does not apply to FP4 experts; the fast FP4 decode kernels live in
`trace_hf.kernels.fp4_moe`. Hints and routing
are recorded and replayed through two attributes that `trace_hf.hints` sets: `_trace_recorder` and
`_trace_guide` (MoE blocks receive no forward kwargs, so state has to live on the module).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import fp4


# Every live FP4 experts module: an optimizer step anywhere invalidates their packed rollout weights. Parameter
# version counters alone are not enough (fused/foreach optimizer kernels may update in place without bumping them).
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _invalidate_after_step(optimizer, args, kwargs) -> None:
    for m in list(_LIVE):
        m.invalidate_packed()


register_optimizer_step_post_hook(_invalidate_after_step)


class TraceFP4Experts(nn.Module):
    """Routed experts computed in FP4. Built from an existing fused experts module by `from_experts`."""

    def __init__(
        self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter, act_fn, fmt: str, activations: str, qat: bool = True
    ):
        super().__init__()
        e, two_i, h = gate_up_proj.shape
        self.num_experts, self.hidden_dim, self.intermediate_dim = e, h, two_i // 2
        block = fp4.get_format(fmt).block_size
        if h % block or self.intermediate_dim % block:
            raise ValueError(
                f"{fmt} needs the experts' hidden size ({h}) and intermediate size ({self.intermediate_dim}) to be "
                f"multiples of {block}; use a model with such sizes or add the experts to modules_to_not_convert."
            )
        # The parameters themselves are adopted (they may still be on the meta device before weight loading).
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn
        self.fmt = fmt
        self.activations = activations
        self.qat = qat  # False: train in the model dtype (the naive FP4-rollout baseline); rollout stays FP4
        # Set by assign_hint_layers and by trace_hf.hints.
        self.moe_index = 0
        self.hinted = False
        self._trace_recorder = None
        self._trace_guide = None
        self._packed = None
        self._fake = None
        _LIVE.add(self)

    @classmethod
    def from_experts(cls, experts: nn.Module, fmt: str, activations: str, qat: bool = True) -> TraceFP4Experts:
        check_fused_experts(experts)
        return cls(experts.gate_up_proj, experts.down_proj, experts.act_fn, fmt, activations, qat)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
            f"fmt={self.fmt}, activations={self.activations}, qat={self.qat}, moe_index={self.moe_index}, hinted={self.hinted}"
        )

    # ------------------------------------------------------------------------------------------------------
    # Weights
    # ------------------------------------------------------------------------------------------------------

    def _version(self) -> tuple:
        gu, d = self.gate_up_proj, self.down_proj
        return (gu._version, gu.data_ptr(), d._version, d.data_ptr(), gu.device)

    def packed_weights(self) -> tuple[fp4.FP4Tensor, fp4.FP4Tensor]:
        """Packed FP4 weights for rollout, re-quantized from the masters whenever they changed: after any optimizer
        step (a global step hook drops the cache) or any other in-place edit (the parameters' version counters)."""
        version = self._version()
        if self._packed is None or self._packed[0] != version:
            with torch.no_grad():
                gu = fp4.quantize(self.gate_up_proj.detach(), self.fmt, scale="expert")
                d = fp4.quantize(self.down_proj.detach(), self.fmt, scale="expert")
            self._packed = (version, gu, d)
        return self._packed[1], self._packed[2]

    def fake_quantized_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized packed weights in the masters' dtype, for the QAT forward: cached until the packed
        weights change, so training quantizes the weights once per optimizer step, not once per forward (at the
        cost of one extra copy of the expert weights)."""
        packed = self.packed_weights()
        if self._fake is None or self._fake[0] is not self._packed:
            self._fake = (self._packed, *(q.dequantize(self.gate_up_proj.dtype) for q in packed))
        return self._fake[1], self._fake[2]

    def invalidate_packed(self) -> None:
        """Drop the packed weights; the next rollout forward re-quantizes them from the masters."""
        self._packed = None
        self._fake = None

    def load_packed_weights(self, gate_up: fp4.FP4Tensor, down: fp4.FP4Tensor) -> None:
        """Install exported packed weights; the masters become their dequantized values."""
        with torch.no_grad():
            self.gate_up_proj.copy_(gate_up.dequantize(self.gate_up_proj.dtype))
            self.down_proj.copy_(down.dequantize(self.down_proj.dtype))
        self._packed = (self._version(), gate_up, down)

    def packed_nbytes(self) -> int:
        gu, d = self.packed_weights()
        return gu.nbytes() + d.nbytes()

    # ------------------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------------------

    def _quantize_input(self, x: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
        if self.activations == "none":
            return x
        if self.training:
            guide = self._trace_guide
            if guide is not None and self.hinted:
                return guide.fake_quantize(self, x)
            return fp4.fake_quantize(x, self.fmt, "row")
        q = fp4.quantize(x, self.fmt, "row")
        if self._trace_recorder is not None:
            self._trace_recorder.record_input(self, q)
        return q.dequantize(x.dtype)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self._trace_recorder is not None and not self.training:
            self._trace_recorder.record_routing(self, top_k_index)
        if self.training and not self.qat:
            return self._routed(
                hidden_states, top_k_index, top_k_weights, lambda e: (self.gate_up_proj[e], self.down_proj[e])
            )
        x = self._quantize_input(hidden_states, top_k_index)
        if self.training:
            # QAT: the fake-quantized weights, computed once per optimizer step, with straight-through gradients to
            # the BF16 masters (the same values as `fp4.fake_quantize(w, fmt, "expert")`).
            w_gu, w_d = self.fake_quantized_weights()
            w_gu = fp4.straight_through(self.gate_up_proj, w_gu)
            w_d = fp4.straight_through(self.down_proj, w_d)

            def weights(e):
                return w_gu[e], w_d[e]
        else:
            packed_gu, packed_d = self.packed_weights()

            def weights(e):
                return (
                    _expert_slice(packed_gu, e).dequantize(x.dtype),
                    _expert_slice(packed_d, e).dequantize(x.dtype),
                )

        return self._routed(x, top_k_index, top_k_weights, weights)

    def _routed(self, x, top_k_index, top_k_weights, weights) -> torch.Tensor:
        """Tokens grouped by expert: one gate/up GEMM, activation, FP4 hidden, one down GEMM per hit expert.

        Expert outputs are summed per token in fp32 (also much faster than a bf16 index_add on CPU)."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts + 1).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start : start + n]
            start += n
            if e >= self.num_experts:  # expert-parallel sentinel: not this rank's expert
                continue
            tok = sel // k
            w_gu, w_d = weights(e)
            gate, up = nn.functional.linear(x[tok], w_gu).chunk(2, dim=-1)
            h = self.act_fn(gate) * up
            if self.activations == "fp4" and (self.qat or not self.training):
                h = fp4.fake_quantize(h, self.fmt, "row")
            y = nn.functional.linear(h, w_d) * top_k_weights.reshape(-1)[sel, None]
            out.index_add_(0, tok, y.float())
        return out.to(x.dtype)


def _expert_slice(q: fp4.FP4Tensor, e: int) -> fp4.FP4Tensor:
    return fp4.FP4Tensor(q.packed[e], q.block_scale[e], q.global_scale[e], q.fmt)


# ----------------------------------------------------------------------------------------------------------
# Finding and replacing experts
# ----------------------------------------------------------------------------------------------------------

SUPPORTED_LAYOUTS = (
    "fused experts modules (transformers 5.x `@use_experts_implementation` style) with 3-D parameters "
    "`gate_up_proj` [E, 2*I, H] (gate and up concatenated) and `down_proj` [E, H, I], no biases, not transposed "
    "(e.g. Qwen3 MoE `qwen3_moe`, Qwen3.5 MoE `qwen3_5_moe_text`, Qwen2 MoE, Qwen3-Next)"
)


def is_fused_experts(module: nn.Module) -> bool:
    gu, d = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gu, nn.Parameter) and isinstance(d, nn.Parameter) and gu.ndim == 3 and d.ndim == 3


def check_fused_experts(module: nn.Module) -> None:
    if not is_fused_experts(module):
        raise ValueError(
            f"{type(module).__name__} is not a supported experts module; trace-hf supports {SUPPORTED_LAYOUTS}."
        )
    e, two_i, h = module.gate_up_proj.shape
    if (
        getattr(module, "is_transposed", False)
        or getattr(module, "has_bias", False)
        or not getattr(module, "has_gate", True)
        or tuple(module.down_proj.shape) != (e, h, two_i // 2)
        or not hasattr(module, "act_fn")
    ):
        raise ValueError(
            f"{type(module).__name__} has a fused-experts layout trace-hf does not handle (transposed, biased, "
            f"gateless, or down_proj {tuple(module.down_proj.shape)} not [E, H, I]); supported are {SUPPORTED_LAYOUTS}."
        )


def _skipped(name: str, modules_to_not_convert: list[str]) -> bool:
    return any(name == m or name.endswith("." + m) or name.startswith(m + ".") for m in modules_to_not_convert)


def replace_experts(
    model: nn.Module, fmt: str, activations: str, modules_to_not_convert: list[str], qat: bool = True
) -> list[str]:
    """Swap every fused experts module for a `TraceFP4Experts`; returns the names replaced (in layer order)."""
    names = [n for n, m in model.named_modules() if is_fused_experts(m)]
    if not names:
        raise ValueError(
            f"{type(model).__name__} has no fused routed-experts module, so TraceFP4Config has nothing to quantize. "
            f"Supported are {SUPPORTED_LAYOUTS}."
        )
    replaced = []
    for name in names:
        if _skipped(name, modules_to_not_convert):
            continue
        model.set_submodule(name, TraceFP4Experts.from_experts(model.get_submodule(name), fmt, activations, qat))
        replaced.append(name)
    return replaced


def fp4_experts(model: nn.Module) -> list[TraceFP4Experts]:
    """The model's FP4 experts modules, in MoE-layer order."""
    return [m for m in model.modules() if isinstance(m, TraceFP4Experts)]


def assign_hint_layers(model: nn.Module, num_hint_layers: int) -> None:
    experts = fp4_experts(model)
    for i, m in enumerate(experts):
        m.moe_index = i
        m.hinted = i >= len(experts) - num_hint_layers


def router_of(model: nn.Module, experts: TraceFP4Experts) -> nn.Module:
    """The router (`gate`) beside an experts module in its MoE block."""
    for block in model.modules():
        if getattr(block, "experts", None) is experts:
            gate = getattr(block, "gate", None) or getattr(block, "router", None)
            if gate is None:
                raise ValueError(f"{type(block).__name__} has no `gate`/`router` module next to its experts.")
            return gate
    raise ValueError("The experts module is not part of this model.")
