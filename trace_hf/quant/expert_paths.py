# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The forward paths of `TraceFP4Experts`, one function each; `TraceFP4Experts.path` picks one per call.

============== =============================================== ================================================
path           when                                            computes
============== =============================================== ================================================
dense_train    train(), ``qat=False`` (the naive baseline)     grouped GEMMs on the BF16 masters, no FP4
kernel_rollout eval(), kernel (``"auto"``: CUDA and NVFP4)     the fused kernels (`trace_hf.kernels.fp4_moe`)
                                                               on the packed weights
kernel_train   train(), frozen, kernel, no experts_hidden      the same kernels (`FrozenKernelExperts`);
               guide                                           backward `frozen_backward`, no weight gradient
torch_frozen   otherwise, frozen                               grouped GEMMs on the dequantized packed buffers
torch_qat      otherwise                                       grouped GEMMs on the dequantized packed weights,
                                                               straight-through to the masters in train()
============== =============================================== ================================================

Each takes ``(m, x, top_k_index, top_k_weights)``: the module, whose weights, settings and `HintSite`s it reads.
The torch paths record (eval) and guide (train) hints in `quantize_input` / `quantize_hidden`; the kernel paths
where their kernels quantize.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers import activations

from .. import fp4
from .expert_weights import dequantize, fields


def dense_train(m, x, top_k_index, top_k_weights) -> torch.Tensor:
    return routed(m, x, top_k_index, top_k_weights, m.gate_up_proj, m.down_proj, False)


def torch_frozen(m, x, top_k_index, top_k_weights) -> torch.Tensor:
    """The packed buffers, dequantized per call inside the grouped GEMMs (again in backward, which gives the input
    gradient only), or the kept dequantized copy with cache_qat_weights."""
    x = quantize_input(m, x)
    w = m.fake_quantized_weights(x.dtype) if m.cache_qat_weights else m.packed_weights()
    return routed(m, x, top_k_index, top_k_weights, *w, m.activations == "fp4")


def torch_qat(m, x, top_k_index, top_k_weights) -> torch.Tensor:
    """The dequantized packed weights (cached per optimizer step unless cache_qat_weights=False); in training with
    straight-through gradients to the BF16 masters (the same values as `fp4.fake_quantize(w, fmt, "expert")`)."""
    x = quantize_input(m, x)
    w_gu, w_d = m.fake_quantized_weights()
    if m.training:
        w_gu = fp4.straight_through(m.gate_up_proj, w_gu)
        w_d = fp4.straight_through(m.down_proj, w_d)
    return routed(m, x, top_k_index, top_k_weights, w_gu, w_d, m.activations == "fp4")


def kernel_rollout(m, x, top_k_index, top_k_weights) -> torch.Tensor:
    """Rollout with the fused kernels: they read the packed FP4 weights (no dequantized copy) and sum the
    products in another order than torch's matmul, so their values differ from the training forward in the
    last bits, as a separate inference engine's would; hints carry the rollout's rounding into training."""
    from trace_hf.kernels import fp4_moe

    gu, d = m.packed_weights()
    xq = x
    site, hidden_site = m.sites.get("experts_input"), m.sites.get("experts_hidden")
    if m.activations == "fp4":
        if site is not None and site.recorder is not None:
            xq, hints = fp4.quantize_with_hints(x, m.fmt, "row")
            site.recorder.record_input(site, xq, hints)
        else:
            xq = fp4.quantize(x, m.fmt, "row")
    # Expert-parallel sentinels (>= E, another rank's expert) contribute nothing, as in `routed`.
    valid = top_k_index < m.num_experts
    ids = top_k_index.clamp(max=m.num_experts - 1)
    w, hidden_fp4 = top_k_weights * valid, m.activations == "fp4"
    kw = {"reduce": True, "bf16_sums": m.prefill_bf16_gemms}
    if hidden_site is not None and hidden_site.recorder is not None:
        y, hidden = fp4_moe.experts_from_quantized(xq, ids, w, gu, d, hidden_fp4, return_hidden=True, **kw)
        hidden_site.recorder.record_hidden(
            hidden_site, hidden.q, hidden.positions(), top_k_index.shape[1], hints=hidden.hints
        )
    else:
        y = fp4_moe.experts_from_quantized(xq, ids, w, gu, d, hidden_fp4, **kw)
    return y.to(x.dtype)


def kernel_train(m, x, top_k_index, top_k_weights) -> torch.Tensor:
    """Training forward of frozen experts through the rollout's kernels (`kernel_rollout`'s values, bit for bit,
    where no hint applies); backward as `frozen_backward`. Hints at experts_input reach the kernels as codes.
    Where the routing weights need a gradient, the FP4 hidden the down projection read is kept for it."""
    xq = None
    if m.activations == "fp4":
        site = m.sites.get("experts_input")
        with torch.no_grad():
            xq = site.guide.experts_input_codes(x) if site is not None and site.guide is not None else None
            xq = fp4.quantize(x, m.fmt, "row") if xq is None else xq
        xq = (xq.packed, xq.block_scale, xq.global_scale)
    valid = top_k_index < m.num_experts  # expert-parallel sentinels contribute nothing, as in `routed`
    ids = top_k_index.clamp(max=m.num_experts - 1)
    keep_hidden = m.activations == "fp4" and torch.is_grad_enabled() and top_k_weights.requires_grad
    # Last in their block, the experts save past any activation checkpoint's hooks: the recompute then has nothing
    # after the router to rebuild and stops there, so the input's quantization and the kernels run once per training
    # forward, for the saved tensors kept from forward to backward (`FrozenKernelExperts`).
    kept = torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is) if m.last_in_block else contextlib.nullcontext()
    with kept:
        return FrozenKernelExperts.apply(x, top_k_weights * valid, ids, m, keep_hidden, *(xq or ()))


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


# ----------------------------------------------------------------------------------------------------------
# The torch paths' pieces
# ----------------------------------------------------------------------------------------------------------


def quantize_input(m, x: torch.Tensor) -> torch.Tensor:
    if m.activations == "none":
        return x
    site = m.sites.get("experts_input")
    if m.training:
        if site is not None and site.guide is not None:
            return site.guide.experts_input(x)
        return fp4.fake_quantize(x, m.fmt, "row")
    if site is not None and site.recorder is not None:
        q, hints = fp4.quantize_with_hints(x, m.fmt, "row")
        site.recorder.record_input(site, q, hints)
    else:
        q = fp4.quantize(x, m.fmt, "row")
    return q.dequantize(x.dtype)


def routed(m, x, top_k_index, top_k_weights, w_gu, w_d, hidden_fp4: bool) -> torch.Tensor:
    """Token-expert pairs sorted by expert: one grouped gate/up GEMM, activation, FP4 hidden, one grouped down
    GEMM (`torch.nn.functional.grouped_mm` on CUDA in bf16: no host sync; a loop over hit experts elsewhere).

    Each token's top-k outputs are summed in fp32 in slot order, so a token's result does not depend on the
    rest of the batch (an atomic `index_add_` would)."""
    t, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    valid = flat < m.num_experts  # expert-parallel sentinel (>= E): another rank's expert, weight 0 here
    ids = flat.clamp(max=m.num_experts - 1)
    ids_sorted, order = torch.sort(ids, stable=True)
    counts = torch.zeros(m.num_experts, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, ids_sorted, torch.ones_like(ids_sorted))
    offsets = counts.cumsum(0).to(torch.int32)
    spans = None if grouped_mm_ok(x, w_gu) else counts.tolist()
    weight = (top_k_weights.reshape(-1) * valid)[order]
    gate, up = grouped_linear(x[order // k], w_gu, offsets, spans).chunk(2, dim=-1)
    h = m.act_fn(gate) * up
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    if hidden_fp4:
        h = quantize_hidden(m, h, top_k_index, order, inverse)
    y = grouped_linear(h, w_d, offsets, spans) * weight[:, None].to(h.dtype)
    return y[inverse].view(t, k, -1).float().sum(1).to(x.dtype)


def quantize_hidden(m, h, top_k_index, order, inverse) -> torch.Tensor:
    """The down projection's input, FP4 per (token, expert) row. Rows arrive sorted by expert; hints are kept per
    token and top-k slot, so recording and guiding see them in that order (``h[inverse]`` is [T * k, I])."""
    site = m.sites.get("experts_hidden")
    if m.training and site is not None and site.guide is not None:
        t, k = top_k_index.shape
        y = site.guide.experts_hidden(h[inverse].unflatten(0, (t, k)), top_k_index)
        return y.flatten(0, 1)[order]
    if not m.training and site is not None and site.recorder is not None:
        q = fp4.quantize(h, m.fmt, "row")
        site.recorder.record_hidden(site, q, inverse, top_k_index.shape[1])
        return q.dequantize(h.dtype)
    return fp4.fake_quantize(h, m.fmt, "row")


def grouped_mm_ok(x: torch.Tensor, w: torch.Tensor | fp4.FP4Tensor) -> bool:
    """Whether the grouped GEMMs run as one `grouped_mm` (bf16 on CUDA) rather than a loop over hit experts."""
    mm = getattr(nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    w_dtype = x.dtype if isinstance(w, fp4.FP4Tensor) else w.dtype  # packed weights dequantize to x's dtype
    return mm is not None and x.is_cuda and x.dtype == w_dtype == torch.bfloat16


def grouped_matmul(x: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, spans: list[int] | None) -> torch.Tensor:
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


def grouped_linear(x: torch.Tensor, w, offsets: torch.Tensor, spans: list[int] | None) -> torch.Tensor:
    """Rows of ``x`` sorted by expert times ``w[e].T`` per expert (``w`` [E, N, K], or frozen packed FP4);
    ``spans`` (rows per expert, on the host) selects the per-expert loop."""
    if isinstance(w, fp4.FP4Tensor):
        return PackedGroupedLinear.apply(x, w.packed, w.block_scale, w.global_scale, w.fmt, offsets, spans)
    if spans is None:
        mm = getattr(nn.functional, "grouped_mm", None) or torch._grouped_mm
        return mm(x, w.transpose(-2, -1), offs=offsets)
    out, start = [], 0
    for e, n in enumerate(spans):
        if n:
            out.append(nn.functional.linear(x[start : start + n], w[e]))
            start += n
    return torch.cat(out) if out else x.new_zeros(0, w.shape[1])


class PackedGroupedLinear(torch.autograd.Function):
    """`grouped_linear` with frozen packed weights: dequantized in forward and again in backward, which returns the
    input gradient only, so no dequantized copy outlives the call (autograd keeps the packed tensors)."""

    @staticmethod
    def forward(ctx, x, packed, block_scale, global_scale, fmt, offsets, spans):
        ctx.save_for_backward(packed, block_scale, global_scale, offsets)
        ctx.fmt, ctx.spans = fmt, spans
        w = dequantize(fp4.FP4Tensor(packed, block_scale, global_scale, fmt), x.dtype)
        return grouped_linear(x, w, offsets, spans)

    @staticmethod
    def backward(ctx, grad):
        packed, block_scale, global_scale, offsets = ctx.saved_tensors
        w = dequantize(fp4.FP4Tensor(packed, block_scale, global_scale, ctx.fmt), grad.dtype)
        return grouped_matmul(grad.contiguous(), w, offsets, ctx.spans), None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------------
# The frozen experts' kernel training path
# ----------------------------------------------------------------------------------------------------------


class FrozenKernelExperts(torch.autograd.Function):
    """Frozen experts' training forward through the fused FP4 kernels (`trace_hf.kernels.fp4_moe`, the rollout's),
    on the input's codes (``xq``: packed, block and row scales; none with dense activations); backward
    `frozen_backward`: input and routing-weight gradients, no weight gradient.

    Saved for backward: the input's codes (a quarter of a bf16 input's bytes; with dense activations the input
    itself) and, with ``keep_hidden``, the FP4 hidden the down projection read, as the kernels left it (rows in
    their sorted, padded layout, with each row's slot): codes, block and row scales, ``I / 2 + I / 16 + 4`` bytes a
    row, about 0.28 of a bf16 hidden's ``2 I``. Backward finds each slot's row; the forward does no gather, since
    under non-reentrant checkpointing it may run twice (its first run's saved tensors dropped) and its recompute
    saves the same bits (the kernels are deterministic). Where the module is last in its block (``last_in_block``)
    they are kept from the forward instead, and it runs once: at Qwen3-30B-A3B's shape ``H / 2 + H / 16 + 4``
    bytes of input codes and ``k`` hidden rows, about 4.7 KB per token and layer."""

    @staticmethod
    def forward(ctx, x, weights, ids, module, keep_hidden, *xq):
        from trace_hf.kernels import fp4_moe

        gu, d = module.packed_weights()
        a = fp4.FP4Tensor(*xq, module.fmt) if xq else x
        hidden_fp4 = module.activations == "fp4"
        kept = ()
        if keep_hidden:
            y, hidden = fp4_moe.experts_from_quantized(a, ids, weights, gu, d, hidden_fp4, return_hidden=True)
            kept = (*fields(hidden.q), hidden.slots)
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
        x = fp4.FP4Tensor(*xq, m.fmt) if ctx.codes else xq[0]
        hidden = None
        if kept:  # the padded rows and the row of each (token, slot)
            from trace_hf.kernels.fp4_moe_common import slot_rows

            hidden = (fp4.FP4Tensor(*kept[:3], m.fmt), slot_rows(kept[3], ids.numel()))
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dx, dw = frozen_backward(m, x, ids, weights, grad.contiguous(), hidden, need_dx, need_dw, ctx.dtype)
        return (dx, dw, None, None, None) + (None,) * ctx.codes


def frozen_backward(m, x, ids, weights, grad, hidden, need_dx, need_dw, dtype=None):
    """Input and routing-weight gradients of the frozen experts at input values ``x`` (the FP4 input as an
    `FP4Tensor`, dequantized to ``dtype`` one (token, slot) row at a time where gate/up are recomputed, or a dense
    tensor): straight-through both FP4 activation quantizations, as `routed`'s autograd does, from the packed
    weights dequantized (or the kept copy with cache_qat_weights).

    The routing weights' gradient is <grad @ W_down[e], hidden>, so no down projection runs. ``hidden`` is the
    FP4 hidden the forward kernel's down projection read and the row of each (token, slot) in it (`FP4Tensor`
    [rows, I], int64 [T * k]), so that gradient is that of the function the forward computed; a gate/up recomputed
    here in bf16 would round 1-2% of the hidden's codes the other way. With dense activations (``hidden`` None)
    the recomputed hidden serves. Gate/up are still recomputed (in ``dtype``) for the SiLU * up derivative of the
    input gradient: the kernels keep only the quantized hidden, and keeping gate/up would hold a [T * k, 2I] copy to
    the backward."""
    t, k = ids.shape
    dtype = dtype or x.dtype
    ids_sorted, order = torch.sort(ids.reshape(-1), stable=True)
    counts = torch.zeros(m.num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, ids_sorted, torch.ones_like(ids_sorted))
    offsets = counts.cumsum(0).to(torch.int32)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    # One projection dequantized at a time (without cache_qat_weights): the down one is dropped before gate/up's.
    cached = m.fake_quantized_weights(dtype) if m.cache_qat_weights else None
    q_gu, q_d = m.packed_weights()
    w_d = cached[1] if cached else dequantize(q_d, dtype)
    spans = None if grouped_mm_ok(grad, w_d) else counts.tolist()
    rows = order // k
    dhq = grouped_matmul(grad[rows], w_d, offsets, spans)  # unweighted: grad @ W_down[e], [T * k, I]
    del w_d
    dx = dw = None
    if need_dw and hidden is not None:  # the kernel's codes in sorted order, dequantized in fp32 for this product
        q, slot_row = hidden
        sel = slot_row[order]
        h = dequantize(fp4.FP4Tensor(*(f[sel] for f in fields(q)), m.fmt), torch.float32)
        dw = (dhq * h).sum(-1)
        del h
    if need_dx or (need_dw and dw is None):  # dense activations: dw reads the recomputed hidden
        w_gu = cached[0] if cached else dequantize(q_gu, dtype)
        # FP4 codes are gathered (a quarter of the bytes) and dequantized as [T * k, H] in one pass, the same values
        # as dequantizing [T, H] and gathering its rows.
        xs = (
            dequantize(fp4.FP4Tensor(*(f[rows] for f in fields(x)), x.fmt), dtype)
            if isinstance(x, fp4.FP4Tensor)
            else x[rows]
        )
        gate, up = grouped_linear(xs, w_gu, offsets, spans).chunk(2, dim=-1)
        del xs
        if need_dw and dw is None:
            dw = (dhq * (m.act_fn(gate) * up)).sum(-1, dtype=torch.float32)
        if need_dx:
            w_sorted = weights.reshape(-1)[order]
            d_gate_up = gated_act_backward(m.act_fn, gate, up, dhq * w_sorted[:, None].to(dhq.dtype))
            dx = grouped_matmul(d_gate_up, w_gu, offsets, spans)
            dx = dx[inverse].view(t, k, -1).sum(1, dtype=torch.float32).to(dtype)
    if dw is not None:
        dw = dw[inverse].view(t, k).to(weights.dtype)
    return dx, dw


#: The SiLU modules models hold as ``act_fn`` (transformers' `ACT2FN["silu"]` is its own `SiLUActivation`).
_SILU_MODULES = (nn.SiLU, *(c for c in [getattr(activations, "SiLUActivation", None)] if c is not None))


def gated_act_backward(act_fn, gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """[d gate | d up] of ``act_fn(gate) * up`` for ``grad``, side by side in one [R, 2I] tensor (what the gate/up
    projection's input gradient reads). For SiLU, the aten kernels autograd would launch (the two products and
    `silu_backward`), written in place: the same values in four passes, without autograd's graph, the product's
    forward or a concatenation. Other activations go through autograd."""
    out = grad.new_empty(grad.shape[0], 2 * grad.shape[1])
    d_gate, d_up = out.chunk(2, dim=-1)
    if act_fn is nn.functional.silu or isinstance(act_fn, _SILU_MODULES):
        torch.mul(grad, nn.functional.silu(gate), out=d_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=d_gate)
        return out
    with torch.enable_grad():
        g, u = gate.detach().requires_grad_(True), up.detach().requires_grad_(True)
        grads = torch.autograd.grad(act_fn(g) * u, (g, u), grad)
    d_gate.copy_(grads[0])
    d_up.copy_(grads[1])
    return out
