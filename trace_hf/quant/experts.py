# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""FP4 routed experts: one module with a QAT path (train) and a packed-FP4 rollout path (eval).

The module keeps the fused 3-D parameters of transformers' experts (`gate_up_proj` [E, 2I, H] and `down_proj`
[E, H, I]) under the same names, so a BF16 checkpoint loads with no conversion and the parameters stay the
trainable BF16 masters. Both paths quantize through `trace_hf.fp4`:

* expert weights: NVFP4/MXFP4 with one global scale per expert (`scale="expert"`), quantized once per
  optimizer step: packed for rollout, dequantized (cached) for the QAT forward;
* experts' input and hidden activation: one global scale per row (token), so a token's quantization does not
  depend on what else is in the batch;

which is what makes the rollout (eval) and the training forward compute the same function. The torch path sorts
token-expert pairs by expert and runs grouped GEMMs (FP4 needs a quantization between the gate/up and the down
projection, which transformers' `ExpertsInterface` kernels have no place for), so the model's
`experts_implementation` setting does not apply to FP4 experts. In eval on CUDA the experts run the fused Triton
kernels of `trace_hf.kernels.fp4_moe` instead (``kernel="auto"``), which read the packed weights: the same
function up to summation order, as a separate rollout engine would compute it. Frozen experts (no masters to give
gradients to) also train through those kernels: their training forward is the eval path's bit for bit, in the
rollout engine's kernels (whose launch configs follow the slot count, so only the summation order can differ).
Hints and routing are recorded and replayed through the module's declared `HintSite`s (``sites``,
`trace_hf.quant.sites`). When the packed weights are re-quantized from the masters is `trace_hf.quant.freshness`.

This module holds the module class (its parameters or buffers, settings and one forward) and the functions that
find and replace experts; where the weights are kept is `expert_weights` (`MasterWeights` / `FrozenWeights`, and
the conversions), what each forward computes is `expert_paths`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .. import fp4
from ..models import EXPERTS_LAST_BLOCKS, decoder_layers, full_attention_layers, is_skipped
from . import expert_paths, expert_weights, freshness
from .expert_weights import PROJS, FrozenWeights, MasterWeights, quantize_experts
from .sites import HintSite, bind_attention


class TraceFP4Experts(nn.Module):
    """Routed experts computed in FP4. Built from an existing fused experts module by `from_experts`.

    Modes: QAT (``qat=True``: fake-quantized masters in train), naive (``qat=False``: the masters as they are in
    train) and frozen (``frozen=True``: packed buffers, no masters); eval is the packed FP4 rollout in all three.
    `weight_store` is the mode's weights (`MasterWeights` or `FrozenWeights`); `path` picks the forward."""

    def __init__(
        self,
        gate_up_proj: nn.Parameter,
        down_proj: nn.Parameter,
        act_fn,
        fmt: str,
        activations: str,
        *,
        qat: bool = True,
        kernel: str = "auto",
        cache_qat_weights: bool = True,
        frozen: bool = False,
        packed_placeholders: bool = False,
        prefill_bf16_gemms: bool = False,
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
        if frozen and not qat:
            raise ValueError(
                "Frozen FP4 experts have no BF16 masters to train without fake quantization: keep qat=True."
            )
        self.frozen = frozen  # `TraceFP4Config.freeze_experts`: packed FP4 buffers only, no BF16 masters
        self.prefill_bf16_gemms = prefill_bf16_gemms  # eval forwards may take the kernels' bf16-sum grouped path
        self.act_fn = act_fn
        self.fmt = fmt
        self.activations = activations
        self.qat = qat  # False: train in the model dtype (the naive FP4-rollout baseline); rollout stays FP4
        self.kernel = kernel  # eval path: "triton" (fused kernels), "torch" (reference) or "auto"
        self.cache_qat_weights = cache_qat_weights  # keep the dequantized weights between optimizer steps
        # Set by assign_hint_layers.
        self.moe_index = 0  # this module's MoE layer (0 = the first MoE layer, not a decoder-layer index)
        self.hinted = False
        self.hint_sites: tuple[str, ...] = ()  # the sites hinted at this layer (`TraceFP4Config.hint_sites`)
        self.kv_layer: int | None = None  # decoder layer whose FP4 K/V are hinted with this layer ("kv" site)
        # Set by replace_experts: whether this module is the last thing its MoE block computes
        # (`trace_hf.models.EXPERTS_LAST_BLOCKS`), so that a checkpointed recompute can stop before it.
        self.last_in_block = False
        self.sites: dict[str, HintSite] = {"routing": HintSite("routing", 0)}  # "routing" and each hinted site
        if frozen:
            # The dtype they dequantize to is the model's (the masters' dtype before quantization).
            self.weight_store: MasterWeights | FrozenWeights = FrozenWeights(gate_up_proj.dtype)
            for name, w in zip(PROJS, (gate_up_proj, down_proj), strict=True):
                self._register_frozen(name, w, packed_placeholders)
        else:
            self.weight_store = MasterWeights()
            # The parameters themselves are adopted (they may still be on the meta device before weight loading).
            self.gate_up_proj = gate_up_proj
            self.down_proj = down_proj
        freshness.LIVE.add(self)

    def _register_frozen(self, name: str, w: torch.Tensor, packed_placeholders: bool) -> None:
        """The buffers of one frozen projection: quantized from `w` now, or, on a meta skeleton, placeholders that
        weight loading fills (`expert_weights.placeholder_buffers`)."""
        if w.device.type != "meta":
            bufs = expert_weights.frozen_buffers(name, quantize_experts(w, self.fmt))
        else:
            bufs = expert_weights.placeholder_buffers(name, w, self.fmt, packed_placeholders)
        for n, b in bufs.items():
            self.register_buffer(n, b)

    def _apply(self, fn, recurse=True):
        """`model.to(dtype)` casts floating buffers; a frozen module's fp32 global scales must stay fp32 (they are
        part of the FP4 format), so only their device follows."""
        scales = {n: b for n, b in self._buffers.items() if self.frozen and n.endswith("_global_scale")}
        super()._apply(fn, recurse)
        for n, b in scales.items():
            moved = self._buffers[n]
            if moved.dtype != b.dtype:
                self._buffers[n] = b.to(moved.device)
        self.weight_store.after_apply(fn)
        return self

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the expert weights dequantize to: the masters' (or, frozen, the model's)."""
        return self.weight_store.weight_dtype(self)

    @classmethod
    def from_experts(cls, experts: nn.Module, config, packed_placeholders: bool = False) -> TraceFP4Experts:
        """Adopt the parameters of a fused experts module, with the settings of a `TraceFP4Config`; with
        `freeze_experts`, quantize them into packed buffers instead (placeholders on a meta skeleton)."""
        check_fused_experts(experts)
        return cls(
            experts.gate_up_proj,
            experts.down_proj,
            experts.act_fn,
            config.fmt,
            config.activations,
            qat=config.qat,
            kernel=config.experts_kernel,
            cache_qat_weights=config.resolved_cache_qat_weights,
            frozen=config.freeze_experts,
            packed_placeholders=packed_placeholders,
            prefill_bf16_gemms=config.prefill_bf16_gemms,
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
            f"fmt={self.fmt}, activations={self.activations}, qat={self.qat}, kernel={self.kernel}, "
            f"cache_qat_weights={self.cache_qat_weights}, frozen={self.frozen}, moe_index={self.moe_index}, "
            f"hinted={self.hinted}"
        )

    # ------------------------------------------------------------------------------------------------------
    # Weights (kept by `weight_store`)
    # ------------------------------------------------------------------------------------------------------

    def packed_weights(self) -> tuple[fp4.FP4Tensor, fp4.FP4Tensor]:
        """Packed FP4 weights for rollout, re-quantized from the masters whenever they changed: after any optimizer
        step (a global step hook drops the cache) or any other in-place edit (the parameters' version counters).
        Frozen experts: their packed buffers themselves (the same objects each time, for the rollout engine)."""
        return self.weight_store.packed_weights(self)

    def refresh_packed(self) -> None:
        """Re-quantize the packed weights from the masters now, whatever changed them (`.data` edits, weight sync,
        an optimizer; none of these is guaranteed to bump the version counters). Rollout engines call it before
        every rollout. Re-quantized in place when the previous packed tensors fit, so their storage (which a
        captured CUDA graph reads) stays where it was. Masters sharded by FSDP2 (outside their layer's forward) are
        only marked stale: the layer's next forward, with the gathered masters, re-quantizes them. Frozen experts
        have nothing to refresh from: their packed buffers are the weights."""
        self.weight_store.refresh(self)

    def pack_from(self, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[fp4.FP4Tensor, fp4.FP4Tensor]:
        """Quantize given full master tensors into the packed weights (in place when they fit) and return them:
        `refresh_packed`, or a caller that gathered sharded masters itself (the rollout engine under FSDP2). Frozen
        experts: the new packed buffers (how to set them from BF16 values one layer at a time)."""
        return self.weight_store.pack_from(self, gate_up, down)

    def fake_quantized_weights(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized packed weights in the masters' dtype (or `dtype`), for the QAT forward (and the torch
        eval path).
        With `cache_qat_weights` they are kept until the packed weights change, so training dequantizes once per
        optimizer step, at the cost of one extra copy of the expert weights; without, every forward dequantizes
        them again (the same values)."""
        dtype = self.weight_dtype if dtype is None else dtype
        return self.weight_store.dequantized_weights(self, dtype, self.cache_qat_weights)

    def invalidate_packed(self) -> None:
        """Mark the packed weights stale; the next rollout forward re-quantizes them from the masters (into the same
        storage). Frozen experts never go stale."""
        self.weight_store.invalidate()

    def load_packed_weights(self, gate_up: fp4.FP4Tensor, down: fp4.FP4Tensor) -> None:
        """Install exported packed weights; the masters become their dequantized values (frozen experts: the
        packed buffers become these tensors, on the module's device)."""
        self.weight_store.load(self, gate_up, down)

    def packed_nbytes(self) -> int:
        gu, d = self.packed_weights()
        return gu.nbytes() + d.nbytes()

    # ------------------------------------------------------------------------------------------------------
    # Forward (the paths are `expert_paths`)
    # ------------------------------------------------------------------------------------------------------

    def _uses_kernel(self, x: torch.Tensor) -> bool:
        """Whether the eval path runs the fused Triton kernels (`trace_hf.kernels.fp4_moe`)."""
        if self.kernel == "auto":
            return x.is_cuda and self.fmt == "nvfp4"
        return self.kernel == "triton"

    def path(self, x: torch.Tensor) -> Callable[..., torch.Tensor]:
        """The forward this call runs (the table in `expert_paths`). Frozen experts train on the rollout's kernels
        where the eval path would use them, except under an experts_hidden guide, which the kernels have no place
        for."""
        if self.training and not self.qat:
            return expert_paths.dense_train
        if not self.training and self._uses_kernel(x):
            return expert_paths.kernel_rollout
        hidden = self.sites.get("experts_hidden")
        if self.training and self.frozen and self._uses_kernel(x) and (hidden is None or hidden.guide is None):
            return expert_paths.kernel_train
        return expert_paths.torch_frozen if self.frozen else expert_paths.torch_qat

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        routing = self.sites["routing"]
        if routing.recorder is not None and not self.training:
            routing.recorder.record_routing(routing, top_k_index)
        return self.path(hidden_states)(self, hidden_states, top_k_index, top_k_weights)


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


def replace_experts(model: nn.Module, config, packed_placeholders: bool = False) -> list[str]:
    """Swap every fused experts module for a `TraceFP4Experts` configured by a `TraceFP4Config` (experts named in
    its `modules_to_not_convert` stay); returns the names replaced (in layer order)."""
    names = [n for n, m in model.named_modules() if is_fused_experts(m)]
    if not names:
        raise ValueError(
            f"{type(model).__name__} has no fused routed-experts module, so TraceFP4Config has nothing to quantize. "
            f"Supported are {SUPPORTED_LAYOUTS}."
        )
    replaced = []
    for name in names:
        if is_skipped(name, config.modules_to_not_convert):
            continue
        experts = TraceFP4Experts.from_experts(model.get_submodule(name), config, packed_placeholders)
        experts.last_in_block = type(model.get_submodule(name.rpartition(".")[0])).__name__ in EXPERTS_LAST_BLOCKS
        model.set_submodule(name, experts)
        replaced.append(name)
    return replaced


def fp4_experts(model: nn.Module) -> list[TraceFP4Experts]:
    """The model's FP4 experts modules, in MoE-layer order."""
    return [m for m in model.modules() if isinstance(m, TraceFP4Experts)]


def kv_attention_of(model: nn.Module, layer: int) -> nn.Module:
    """The attention module of decoder layer `layer`, whose K/V the "kv" hint site guides."""
    attn = getattr(decoder_layers(model, TraceFP4Experts)[layer], "self_attn", None)
    if attn is None:
        raise ValueError(f"Decoder layer {layer} has no `self_attn` module; the 'kv' hint site needs one.")
    return attn


def assign_hint_layers(model: nn.Module, num_hint_layers: int, sites=("experts_input",)) -> None:
    """Mark the last `num_hint_layers` MoE layers as hinted at `sites` and install their `HintSite`s; for "kv", the
    full-attention layer of the same decoder layer (`kv_layer`; None where the decoder layer has linear attention,
    which caches no K/V), whose attention module the site is bound to."""
    experts = fp4_experts(model)
    layers = decoder_layers(model, TraceFP4Experts)
    where = {}
    if layers is not None:
        for j, layer in enumerate(layers):
            where.update({id(m): j for m in layer.modules() if isinstance(m, TraceFP4Experts)})
    full = set(full_attention_layers(model.config)) if layers is not None else set()
    for i, m in enumerate(experts):
        j = where.get(id(m))
        m.moe_index = i
        m.hinted = i >= len(experts) - num_hint_layers
        m.hint_sites = tuple(sites) if m.hinted else ()
        m.kv_layer = j if "kv" in m.hint_sites and j in full and hasattr(layers[j], "self_attn") else None
        m.sites = {"routing": HintSite("routing", i, j)}
        m.sites.update({s: HintSite(s, i, j) for s in m.hint_sites if s != "kv"})
        if j is not None and j in full and hasattr(layers[j], "self_attn"):
            kv = HintSite("kv", i, j) if m.kv_layer is not None else None
            if kv is not None:
                m.sites["kv"] = kv
            bind_attention(layers[j].self_attn, kv)
