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
rollout engine's kernels (whose launch configs follow the slot count, so only the summation order can differ). Hints and routing are recorded and
replayed through the module's declared `HintSite`s (``sites``, `trace_hf.quant.sites`). When the packed weights are
re-quantized from the masters is `trace_hf.quant.freshness`.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import fp4
from ..models import decoder_layers, full_attention_layers, is_skipped
from . import freshness
from .sites import HintSite, bind_attention


#: The two projections, and the buffer-name suffix of each `FP4Tensor` field of a frozen one: the codes keep the
#: parameter's own name (as transformers' NVFP4 layers keep theirs under `weight`), so a BF16 checkpoint's tensor
#: loads, and is quantized, under it.
_PROJS = ("gate_up_proj", "down_proj")
_FROZEN_SUFFIXES = {"packed": "", "block_scale": "_block_scale", "global_scale": "_global_scale"}
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class TraceFP4Experts(nn.Module):
    """Routed experts computed in FP4. Built from an existing fused experts module by `from_experts`."""

    def __init__(
        self,
        gate_up_proj: nn.Parameter,
        down_proj: nn.Parameter,
        act_fn,
        fmt: str,
        activations: str,
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
        self._frozen_dtype = gate_up_proj.dtype  # frozen experts: the dtype they dequantize to (the model's)
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
        self.sites: dict[str, HintSite] = {"routing": HintSite("routing", 0)}  # "routing" and each hinted site
        self._packed = None
        self._packed_storage = None  # the packed tensors, kept across invalidations so refreshes reuse them
        self._packed_sample = ()  # `_masters_sample()` when the packed weights were made
        self._fake = None
        if frozen:
            for name, w in zip(_PROJS, (gate_up_proj, down_proj), strict=True):
                self._register_frozen(name, w, packed_placeholders)
        else:
            # The parameters themselves are adopted (they may still be on the meta device before weight loading).
            self.gate_up_proj = gate_up_proj
            self.down_proj = down_proj
        freshness.LIVE.add(self)

    def _register_frozen(self, name: str, w: torch.Tensor, packed_placeholders: bool) -> None:
        """The buffers of one frozen projection: quantized from `w` now, or, on a meta skeleton, placeholders that
        weight loading fills (`w`'s own shape, quantized by `TraceFP4Quantize` as its checkpoint tensor loads; or the
        packed layout, for a checkpoint that already holds the codes)."""
        if w.device.type != "meta":
            q = fp4.quantize(w.detach(), self.fmt, scale="expert")
            for field, suffix in _FROZEN_SUFFIXES.items():
                self.register_buffer(name + suffix, getattr(q, field))
            return
        e, n, k = w.shape
        bs = fp4.get_format(self.fmt).block_size
        g_shape = (e, 1, 1) if self.fmt == "nvfp4" else (e, n, 1)
        meta = {"device": "meta"}
        codes = torch.empty(e, n, k // 2, dtype=torch.uint8, **meta) if packed_placeholders else torch.empty_like(w)
        self.register_buffer(name, codes)
        self.register_buffer(name + "_block_scale", torch.empty(e, n, k // bs, dtype=torch.uint8, **meta))
        self.register_buffer(name + "_global_scale", torch.empty(g_shape, dtype=torch.float32, **meta))

    def _apply(self, fn, recurse=True):
        """`model.to(dtype)` casts floating buffers; a frozen module's fp32 global scales must stay fp32 (they are
        part of the FP4 format), so only their device follows."""
        scales = {n: b for n, b in self._buffers.items() if self.frozen and n.endswith("_global_scale")}
        super()._apply(fn, recurse)
        for n, b in scales.items():
            moved = self._buffers[n]
            if moved.dtype != b.dtype:
                self._buffers[n] = b.to(moved.device)
        if self.frozen:  # the cached FP4Tensor views hold the buffers from before; the model dtype may have changed
            self._packed = self._fake = None
            self._frozen_dtype = fn(torch.empty(0, dtype=self._frozen_dtype)).dtype
        return self

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the expert weights dequantize to: the masters' (or, frozen, the model's)."""
        return self._frozen_dtype if self.frozen else self.gate_up_proj.dtype

    @classmethod
    def from_experts(cls, experts: nn.Module, config, packed_placeholders: bool = False) -> TraceFP4Experts:
        """Adopt the parameters of a fused experts module, with the settings of a `TraceFP4Config`; with
        `freeze_experts`, quantize them into packed buffers instead (placeholders on a meta skeleton)."""
        check_fused_experts(experts)
        return cls(
            experts.gate_up_proj, experts.down_proj, experts.act_fn, config.fmt, config.activations, config.qat,
            config.experts_kernel, config.resolved_cache_qat_weights, config.freeze_experts, packed_placeholders,
            config.prefill_bf16_gemms,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
            f"fmt={self.fmt}, activations={self.activations}, qat={self.qat}, kernel={self.kernel}, "
            f"cache_qat_weights={self.cache_qat_weights}, frozen={self.frozen}, moe_index={self.moe_index}, "
            f"hinted={self.hinted}"
        )

    # ------------------------------------------------------------------------------------------------------
    # Weights
    # ------------------------------------------------------------------------------------------------------

    def _version(self) -> tuple:
        gu, d = self.gate_up_proj, self.down_proj
        return (gu._version, gu.data_ptr(), d._version, d.data_ptr(), gu.device)

    def _frozen_weights(self) -> tuple[fp4.FP4Tensor, fp4.FP4Tensor]:
        """The packed buffers as `FP4Tensor`s (kept, so that the rollout engine sees the same objects each time)."""
        bufs = tuple(self._buffers[p + suffix] for p in _PROJS for suffix in _FROZEN_SUFFIXES.values())
        if self._packed is None or any(a is not b for a, b in zip(self._packed[0], bufs, strict=True)):
            if bufs[0].device.type == "meta" or bufs[0].dtype != torch.uint8:
                raise RuntimeError(
                    "These frozen FP4 experts hold no weights yet (still placeholders): load them with "
                    "from_pretrained(..., quantization_config=TraceFP4Config(freeze_experts=True)), or install packed "
                    "weights with load_packed_weights / pack_from."
                )
            gu, d = fp4.FP4Tensor(*bufs[:3], self.fmt), fp4.FP4Tensor(*bufs[3:], self.fmt)
            self._packed = (bufs, gu, d)
            self._packed_storage = (gu, d)
        return self._packed[1], self._packed[2]

    def packed_weights(self) -> tuple[fp4.FP4Tensor, fp4.FP4Tensor]:
        """Packed FP4 weights for rollout, re-quantized from the masters whenever they changed: after any optimizer
        step (a global step hook drops the cache) or any other in-place edit (the parameters' version counters).
        Frozen experts: their packed buffers themselves."""
        if self.frozen:
            return self._frozen_weights()
        version = self._version()
        # In training, also a sample of the masters: `.data` edits and weight syncs bump no version counter.
        if self._packed is None or self._packed[0] != version or (self.training and self._masters_edited()):
            self.refresh_packed()
        elif freshness.DEBUG and self._fingerprint() != self._packed_fingerprint:
            raise RuntimeError(
                "TraceFP4Experts: the BF16 masters changed without a refresh (an in-place `.data` edit or a weight "
                "sync), so the packed FP4 weights are stale. Call trace_hf.refresh_fp4_weights(model) after such "
                "updates."
            )
        return self._packed[1], self._packed[2]

    def _masters_sample(self) -> tuple[torch.Tensor, ...]:
        """Bits of every n-th master element (about 4K per tensor). A write through `.data` (a weight sync, a user's
        own loop) changes the values but not `_version`, so training would reuse stale fake-quantized weights; this
        sample sees any such write that touches the sampled elements (any whole-tensor update) for one small read and
        a host sync per training forward. `TRACE_HF_DEBUG=1` adds a full-tensor check."""
        if _is_dtensor(self.gate_up_proj):
            return ()
        out = []
        for t in (self.gate_up_proj, self.down_proj):
            s = t.detach().reshape(-1)[:: max(1, t.numel() // 4096)].contiguous()
            out.append(s.view(_SAME_SIZE_INT[s.element_size()]))
        return tuple(out)

    def _masters_edited(self) -> bool:
        now = self._masters_sample()
        return len(now) != len(self._packed_sample) or not all(map(torch.equal, now, self._packed_sample))

    def _fingerprint(self) -> tuple[float, ...]:
        with torch.no_grad():
            return tuple(float(t.detach().float().sum()) for t in (self.gate_up_proj, self.down_proj)) + tuple(
                float(t.detach().float().abs().sum()) for t in (self.gate_up_proj, self.down_proj)
            )

    def refresh_packed(self) -> None:
        """Re-quantize the packed weights from the masters now, whatever changed them (`.data` edits, weight sync,
        an optimizer; none of these is guaranteed to bump the version counters). Rollout engines call it before
        every rollout. Re-quantized in place when the previous packed tensors fit, so their storage (which a
        captured CUDA graph reads) stays where it was. Masters sharded by FSDP2 (outside their layer's forward) are
        only marked stale: the layer's next forward, with the gathered masters, re-quantizes them. Frozen experts
        have nothing to refresh from: their packed buffers are the weights."""
        if self.frozen:
            self._frozen_weights()
            return
        if _is_dtensor(self.gate_up_proj):
            self._packed = None
            self._fake = None
            return
        self.pack_from(self.gate_up_proj, self.down_proj)

    def pack_from(self, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[fp4.FP4Tensor, fp4.FP4Tensor]:
        """Quantize given full master tensors into the packed weights (in place when they fit) and return them:
        `refresh_packed`, or a caller that gathered sharded masters itself (the rollout engine under FSDP2). Frozen
        experts: the new packed buffers (how to set them from BF16 values one layer at a time)."""
        with torch.no_grad():
            gu = fp4.quantize(gate_up.detach(), self.fmt, scale="expert")
            d = fp4.quantize(down.detach(), self.fmt, scale="expert")
        if self.frozen:
            self.load_packed_weights(gu, d)
            return self._frozen_weights()
        with torch.no_grad():
            old = self._packed_storage
            if old is not None and all(_same_layout(a, b) for a, b in zip(old, (gu, d))):
                for a, b in zip(old, (gu, d)):
                    a.packed.copy_(b.packed)
                    a.block_scale.copy_(b.block_scale)
                    a.global_scale.copy_(b.global_scale)
                gu, d = old
        self._packed_storage = (gu, d)
        # A new tuple: the dequantized QAT cache (`_fake`) is keyed on its identity.
        self._packed = (self._version(), gu, d)
        self._packed_sample = self._masters_sample()
        if freshness.DEBUG:
            self._packed_fingerprint = self._fingerprint()
        return gu, d

    def fake_quantized_weights(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized packed weights in the masters' dtype (or `dtype`), for the QAT forward (and the torch
        eval path).
        With `cache_qat_weights` they are kept until the packed weights change, so training dequantizes once per
        optimizer step, at the cost of one extra copy of the expert weights; without, every forward dequantizes
        them again (the same values)."""
        packed = self.packed_weights()
        dtype = self.weight_dtype if dtype is None else dtype
        deq = _dequantize if self.frozen else fp4.FP4Tensor.dequantize
        if not self.cache_qat_weights:
            return tuple(deq(q, dtype) for q in packed)
        if self._fake is None or self._fake[0] is not self._packed or self._fake[1].dtype != dtype:
            self._fake = (self._packed, *(deq(q, dtype) for q in packed))
        return self._fake[1], self._fake[2]

    def invalidate_packed(self) -> None:
        """Mark the packed weights stale; the next rollout forward re-quantizes them from the masters (into the same
        storage). Frozen experts never go stale."""
        if self.frozen:
            return
        self._packed = None
        self._fake = None

    def load_packed_weights(self, gate_up: fp4.FP4Tensor, down: fp4.FP4Tensor) -> None:
        """Install exported packed weights; the masters become their dequantized values (frozen experts: the
        packed buffers become these tensors, on the module's device)."""
        if self.frozen:
            self._load_frozen(gate_up, down)
            return
        with torch.no_grad():
            self.gate_up_proj.copy_(gate_up.dequantize(self.gate_up_proj.dtype))
            self.down_proj.copy_(down.dequantize(self.down_proj.dtype))
        self._packed = (self._version(), gate_up, down)
        self._packed_storage = (gate_up, down)
        self._packed_sample = self._masters_sample()

    def _load_frozen(self, gate_up: fp4.FP4Tensor, down: fp4.FP4Tensor) -> None:
        want_k = {"gate_up_proj": self.hidden_dim, "down_proj": self.intermediate_dim}
        want_n = {"gate_up_proj": 2 * self.intermediate_dim, "down_proj": self.hidden_dim}
        for name, q in zip(_PROJS, (gate_up, down), strict=True):
            shape = (self.num_experts, want_n[name], want_k[name])
            if q.fmt != self.fmt or tuple(q.shape) != shape:
                raise ValueError(
                    f"load_packed_weights: {name} is {q.fmt} of shape {tuple(q.shape)}, but these experts hold {self.fmt} "
                    f"of shape {shape}; quantize the weights with fp4.quantize(w, {self.fmt!r}, scale='expert')."
                )
            old = self._buffers[name]
            device = old.device if old.device.type != "meta" else q.packed.device
            for field, suffix in _FROZEN_SUFFIXES.items():
                t = getattr(q, field).detach().to(device)
                self._buffers[name + suffix] = t.float() if field == "global_scale" else t.contiguous()
        self._packed = self._fake = None

    def packed_nbytes(self) -> int:
        gu, d = self.packed_weights()
        return gu.nbytes() + d.nbytes()

    # ------------------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------------------

    def _quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations == "none":
            return x
        site = self.sites.get("experts_input")
        if self.training:
            if site is not None and site.guide is not None:
                return site.guide.experts_input(x)
            return fp4.fake_quantize(x, self.fmt, "row")
        if site is not None and site.recorder is not None:
            q, hints = fp4.quantize_with_hints(x, self.fmt, "row")
            site.recorder.record_input(site, q, hints)
        else:
            q = fp4.quantize(x, self.fmt, "row")
        return q.dequantize(x.dtype)

    def _uses_kernel(self, x: torch.Tensor) -> bool:
        """Whether the eval path runs the fused Triton kernels (`trace_hf.kernels.fp4_moe`)."""
        if self.kernel == "auto":
            return x.is_cuda and self.fmt == "nvfp4"
        return self.kernel == "triton"

    def _trains_on_kernel(self, x: torch.Tensor) -> bool:
        """Whether a training forward runs the rollout's fused kernels (`_FrozenKernelExperts`): frozen experts where
        the eval path would (`kernel`), except under an experts_hidden guide, which the kernels have no place for."""
        hidden = self.sites.get("experts_hidden")
        return self.frozen and self._uses_kernel(x) and (hidden is None or hidden.guide is None)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        routing = self.sites["routing"]
        if routing.recorder is not None and not self.training:
            routing.recorder.record_routing(routing, top_k_index)
        if self.training and not self.qat:
            return self._routed(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, False)
        if not self.training and self._uses_kernel(hidden_states):
            return self._kernel_forward(hidden_states, top_k_index, top_k_weights)
        if self.training and self._trains_on_kernel(hidden_states):
            return self._kernel_train_forward(hidden_states, top_k_index, top_k_weights)
        x = self._quantize_input(hidden_states)
        if self.frozen:
            # The packed buffers, dequantized per call inside the grouped GEMMs (again in backward, which gives the
            # input gradient only), or the kept dequantized copy with cache_qat_weights.
            w = self.fake_quantized_weights(x.dtype) if self.cache_qat_weights else self.packed_weights()
            return self._routed(x, top_k_index, top_k_weights, *w, self.activations == "fp4")
        # The dequantized packed weights (cached per optimizer step unless cache_qat_weights=False); in training with
        # straight-through gradients to the BF16 masters (the same values as `fp4.fake_quantize(w, fmt, "expert")`).
        w_gu, w_d = self.fake_quantized_weights()
        if self.training:
            w_gu = fp4.straight_through(self.gate_up_proj, w_gu)
            w_d = fp4.straight_through(self.down_proj, w_d)
        return self._routed(x, top_k_index, top_k_weights, w_gu, w_d, self.activations == "fp4")

    def _kernel_forward(self, x, top_k_index, top_k_weights) -> torch.Tensor:
        """Rollout with the fused kernels: they read the packed FP4 weights (no dequantized copy) and sum the
        products in another order than torch's matmul, so their values differ from the training forward in the
        last bits, as a separate inference engine's would; hints carry the rollout's rounding into training."""
        from trace_hf.kernels import fp4_moe

        gu, d = self.packed_weights()
        xq = x
        site, hidden_site = self.sites.get("experts_input"), self.sites.get("experts_hidden")
        if self.activations == "fp4":
            if site is not None and site.recorder is not None:
                xq, hints = fp4.quantize_with_hints(x, self.fmt, "row")
                site.recorder.record_input(site, xq, hints)
            else:
                xq = fp4.quantize(x, self.fmt, "row")
        # Expert-parallel sentinels (>= E, another rank's expert) contribute nothing, as in `_routed`.
        valid = top_k_index < self.num_experts
        ids = top_k_index.clamp(max=self.num_experts - 1)
        w, hidden_fp4 = top_k_weights * valid, self.activations == "fp4"
        kw = {"reduce": True, "bf16_sums": self.prefill_bf16_gemms}
        if hidden_site is not None and hidden_site.recorder is not None:
            y, hidden = fp4_moe.experts_from_quantized(xq, ids, w, gu, d, hidden_fp4, return_hidden=True, **kw)
            hidden_site.recorder.record_hidden(
                hidden_site, hidden.q, hidden.positions(), top_k_index.shape[1], hints=hidden.hints
            )
        else:
            y = fp4_moe.experts_from_quantized(xq, ids, w, gu, d, hidden_fp4, **kw)
        return y.to(x.dtype)

    def _kernel_train_forward(self, x, top_k_index, top_k_weights) -> torch.Tensor:
        """Training forward of frozen experts through the rollout's kernels (`_kernel_forward`'s values, bit for bit,
        where no hint applies); backward as `_frozen_backward`. Hints at experts_input reach the kernels as codes.
        Where the routing weights need a gradient, the FP4 hidden the down projection read is kept for it."""
        xq = None
        if self.activations == "fp4":
            site = self.sites.get("experts_input")
            with torch.no_grad():
                xq = site.guide.experts_input_codes(x) if site is not None and site.guide is not None else None
                xq = fp4.quantize(x, self.fmt, "row") if xq is None else xq
            xq = (xq.packed, xq.block_scale, xq.global_scale)
        valid = top_k_index < self.num_experts  # expert-parallel sentinels contribute nothing, as in `_routed`
        ids = top_k_index.clamp(max=self.num_experts - 1)
        keep_hidden = self.activations == "fp4" and torch.is_grad_enabled() and top_k_weights.requires_grad
        return _FrozenKernelExperts.apply(x, top_k_weights * valid, ids, self, keep_hidden, *(xq or ()))

    def _frozen_backward(self, x, ids, weights, grad, hidden, need_dx, need_dw):
        """Input and routing-weight gradients of the frozen experts at input values ``x`` (the FP4 input,
        dequantized): straight-through both FP4 activation quantizations, as `_routed`'s autograd does, from the
        packed weights dequantized (or the kept copy with cache_qat_weights).

        The routing weights' gradient is <grad @ W_down[e], hidden>, so no down projection runs. ``hidden`` is the
        FP4 hidden the forward kernel's down projection read (`FP4Tensor` [T * k, I], rows in slot order), so that
        gradient is that of the function the forward computed; a gate/up recomputed here in bf16 would round 1-2% of
        the hidden's codes the other way. With dense activations (``hidden`` None) the recomputed hidden serves.
        Gate/up are still recomputed (in ``x``'s dtype) for the SiLU * up derivative of the input gradient: the
        kernels keep only the quantized hidden, and keeping gate/up would hold a [T * k, 2I] copy to the backward."""
        t, k = ids.shape
        ids_sorted, order = torch.sort(ids.reshape(-1), stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, ids_sorted, torch.ones_like(ids_sorted))
        offsets = counts.cumsum(0).to(torch.int32)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        # One projection dequantized at a time (without cache_qat_weights): the down one is dropped before gate/up's.
        cached = self.fake_quantized_weights(x.dtype) if self.cache_qat_weights else None
        q_gu, q_d = self.packed_weights()
        w_d = cached[1] if cached else _dequantize(q_d, x.dtype)
        spans = None if _grouped_mm_ok(x, w_d) else counts.tolist()
        rows = order // k
        dhq = _grouped_matmul(grad[rows], w_d, offsets, spans)  # unweighted: grad @ W_down[e], [T * k, I]
        del w_d
        dx = dw = None
        if need_dw and hidden is not None:  # the kernel's codes in sorted order, dequantized in fp32 for this product
            h = _dequantize(fp4.FP4Tensor(*(f[order] for f in _fields(hidden)), self.fmt), torch.float32)
            dw = (dhq * h).sum(-1)
            del h
        if need_dx or (need_dw and dw is None):  # dense activations: dw reads the recomputed hidden
            w_gu = cached[0] if cached else _dequantize(q_gu, x.dtype)
            gate, up = _grouped_linear(x[rows], w_gu, offsets, spans).chunk(2, dim=-1)
            with torch.enable_grad():
                gate, up = gate.detach().requires_grad_(True), up.detach().requires_grad_(True)
                h = self.act_fn(gate) * up
            if need_dw and dw is None:
                dw = (dhq * h.detach()).sum(-1, dtype=torch.float32)
            if need_dx:
                w_sorted = weights.reshape(-1)[order]
                dgate, dup = torch.autograd.grad(h, (gate, up), dhq * w_sorted[:, None].to(dhq.dtype))
                dx = _grouped_matmul(torch.cat([dgate, dup], dim=-1), w_gu, offsets, spans)
                dx = dx[inverse].view(t, k, -1).sum(1, dtype=torch.float32).to(x.dtype)
        if dw is not None:
            dw = dw[inverse].view(t, k).to(weights.dtype)
        return dx, dw

    def _routed(self, x, top_k_index, top_k_weights, w_gu, w_d, hidden_fp4: bool) -> torch.Tensor:
        """Token-expert pairs sorted by expert: one grouped gate/up GEMM, activation, FP4 hidden, one grouped down
        GEMM (`torch.nn.functional.grouped_mm` on CUDA in bf16: no host sync; a loop over hit experts elsewhere).

        Each token's top-k outputs are summed in fp32 in slot order, so a token's result does not depend on the
        rest of the batch (an atomic `index_add_` would)."""
        t, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        valid = flat < self.num_experts  # expert-parallel sentinel (>= E): another rank's expert, weight 0 here
        ids = flat.clamp(max=self.num_experts - 1)
        ids_sorted, order = torch.sort(ids, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, ids_sorted, torch.ones_like(ids_sorted))
        offsets = counts.cumsum(0).to(torch.int32)
        spans = None if _grouped_mm_ok(x, w_gu) else counts.tolist()
        weight = (top_k_weights.reshape(-1) * valid)[order]
        gate, up = _grouped_linear(x[order // k], w_gu, offsets, spans).chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        if hidden_fp4:
            h = self._quantize_hidden(h, top_k_index, order, inverse)
        y = _grouped_linear(h, w_d, offsets, spans) * weight[:, None].to(h.dtype)
        return y[inverse].view(t, k, -1).float().sum(1).to(x.dtype)

    def _quantize_hidden(self, h, top_k_index, order, inverse) -> torch.Tensor:
        """The down projection's input, FP4 per (token, expert) row. Rows arrive sorted by expert; hints are kept per
        token and top-k slot, so recording and guiding see them in that order (``h[inverse]`` is [T * k, I])."""
        site = self.sites.get("experts_hidden")
        if self.training and site is not None and site.guide is not None:
            t, k = top_k_index.shape
            y = site.guide.experts_hidden(h[inverse].unflatten(0, (t, k)), top_k_index)
            return y.flatten(0, 1)[order]
        if not self.training and site is not None and site.recorder is not None:
            q = fp4.quantize(h, self.fmt, "row")
            site.recorder.record_hidden(site, q, inverse, top_k_index.shape[1])
            return q.dequantize(h.dtype)
        return fp4.fake_quantize(h, self.fmt, "row")


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _same_layout(a: fp4.FP4Tensor, b: fp4.FP4Tensor) -> bool:
    return all(
        x.shape == y.shape and x.dtype == y.dtype and x.device == y.device
        for x, y in ((a.packed, b.packed), (a.block_scale, b.block_scale), (a.global_scale, b.global_scale))
    )


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor | fp4.FP4Tensor) -> bool:
    mm = getattr(nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    w_dtype = x.dtype if isinstance(w, fp4.FP4Tensor) else w.dtype  # packed weights dequantize to x's dtype
    return mm is not None and x.is_cuda and x.dtype == w_dtype == torch.bfloat16


def _dequantize(q: fp4.FP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`FP4Tensor.dequantize`, through the Triton kernel on CUDA (the same values, bit for bit)."""
    if q.packed.is_cuda:
        from trace_hf.kernels.fp4_quant import dequantize

        return dequantize(q, dtype)
    return q.dequantize(dtype)


class _PackedGroupedLinear(torch.autograd.Function):
    """`_grouped_linear` with frozen packed weights: dequantized in forward and again in backward, which returns the
    input gradient only, so no dequantized copy outlives the call (autograd keeps the packed tensors)."""

    @staticmethod
    def forward(ctx, x, packed, block_scale, global_scale, fmt, offsets, spans):
        ctx.save_for_backward(packed, block_scale, global_scale, offsets)
        ctx.fmt, ctx.spans = fmt, spans
        w = _dequantize(fp4.FP4Tensor(packed, block_scale, global_scale, fmt), x.dtype)
        return _grouped_linear(x, w, offsets, spans)

    @staticmethod
    def backward(ctx, grad):
        packed, block_scale, global_scale, offsets = ctx.saved_tensors
        w = _dequantize(fp4.FP4Tensor(packed, block_scale, global_scale, ctx.fmt), grad.dtype)
        return _grouped_matmul(grad.contiguous(), w, offsets, ctx.spans), None, None, None, None, None, None


class _FrozenKernelExperts(torch.autograd.Function):
    """Frozen experts' training forward through the fused FP4 kernels (`trace_hf.kernels.fp4_moe`, the rollout's),
    on the input's codes (``xq``: packed, block and row scales; none with dense activations); backward
    `TraceFP4Experts._frozen_backward`: input and routing-weight gradients, no weight gradient.

    Saved for backward: the input's codes (a quarter of a bf16 input's bytes; with dense activations the input
    itself) and, with ``keep_hidden``, the FP4 hidden the down projection read, compacted to slot order: codes,
    block and row scales, ``I / 2 + I / 16 + 4`` bytes a slot, about 0.28 of a bf16 hidden's ``2 I``. Under
    non-reentrant checkpointing the forward reruns in backward and saves them again, the same bits (the kernels
    are deterministic)."""

    @staticmethod
    def forward(ctx, x, weights, ids, module, keep_hidden, *xq):
        from trace_hf.kernels import fp4_moe

        gu, d = module.packed_weights()
        a = fp4.FP4Tensor(*xq, module.fmt) if xq else x
        hidden_fp4 = module.activations == "fp4"
        kept = ()
        if keep_hidden:
            y, hidden = fp4_moe.experts_from_quantized(a, ids, weights, gu, d, hidden_fp4, return_hidden=True)
            pos = hidden.positions()  # padded sorted rows -> slot order, padding dropped
            kept = tuple(f[pos] for f in _fields(hidden.q))
        else:
            y = fp4_moe.experts_from_quantized(a, ids, weights, gu, d, hidden_fp4)
        ctx.module, ctx.dtype, ctx.codes, ctx.kept = module, x.dtype, len(xq), len(kept)
        ctx.save_for_backward(weights, ids, *kept, *(xq or (x,)))
        return y.sum(1).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        weights, ids, *rest = ctx.saved_tensors
        kept, xq = rest[: ctx.kept], rest[ctx.kept :]
        m = ctx.module
        x = _dequantize(fp4.FP4Tensor(*xq, m.fmt), ctx.dtype) if ctx.codes else xq[0]
        hidden = fp4.FP4Tensor(*kept, m.fmt) if kept else None
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dx, dw = m._frozen_backward(x, ids, weights, grad.contiguous(), hidden, need_dx, need_dw)
        return (dx, dw, None, None, None) + (None,) * ctx.codes


def _fields(q: fp4.FP4Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.packed, q.block_scale, q.global_scale


def _grouped_matmul(x: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, spans: list[int] | None) -> torch.Tensor:
    """Rows of ``x`` sorted by expert times ``b[e]`` per expert (``b`` [E, K, N])."""
    if spans is None:
        mm = getattr(nn.functional, "grouped_mm", None) or torch._grouped_mm
        return mm(x, b, offs=offsets)
    out, start = [], 0
    for e, n in enumerate(spans):
        if n:
            out.append(x[start : start + n] @ b[e])
            start += n
    return torch.cat(out) if out else x.new_zeros(0, b.shape[2])


def _grouped_linear(x: torch.Tensor, w, offsets: torch.Tensor, spans: list[int] | None) -> torch.Tensor:
    """Rows of ``x`` sorted by expert times ``w[e].T`` per expert (``w`` [E, N, K], or frozen packed FP4);
    ``spans`` (rows per expert, on the host) selects the per-expert loop."""
    if isinstance(w, fp4.FP4Tensor):
        return _PackedGroupedLinear.apply(x, w.packed, w.block_scale, w.global_scale, w.fmt, offsets, spans)
    if spans is None:
        mm = getattr(nn.functional, "grouped_mm", None) or torch._grouped_mm
        return mm(x, w.transpose(-2, -1), offs=offsets)
    out, start = [], 0
    for e, n in enumerate(spans):
        if n:
            out.append(nn.functional.linear(x[start : start + n], w[e]))
            start += n
    return torch.cat(out) if out else x.new_zeros(0, w.shape[1])


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
        model.set_submodule(name, TraceFP4Experts.from_experts(model.get_submodule(name), config, packed_placeholders))
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
