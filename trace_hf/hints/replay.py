# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Replay: `use_hints` guides the training forward with the rollout's hints and routing."""

from __future__ import annotations

import contextlib

import torch

from .. import fp4
from ..models import routers_of
from ..quant.experts import fp4_experts
from ..quant.sites import SiteGuide
from .batch import HintBatch
from .plan import plan_of, site_on
from .report import MismatchReport, _warn_if_off_policy
from .routing import check_replayable, routing_hook


class Guide(SiteGuide):
    """The rollout's hints of one (site, MoE layer), laid out per token of the flattened [B * S] training batch, and
    the one rule that applies them: guided where a token has a hint (`trace_hf.fp4.guided_quantize`), nearest with
    the training scales elsewhere; every flip the hints correct is counted in the report under (site, layer).

    Call it as its site's module does (`SiteGuide` names those calls): the experts input [B * S, H]; the experts
    hidden activation [T, top_k, I] and the router's top-k; the attention's K and V [B, kv_heads, S, D].
    """

    def __init__(self, site: str, hints: fp4.FP4Hints, has: torch.Tensor, n_has: int, layer: int,
                 report: MismatchReport, apply: bool, routing: torch.Tensor | None = None):  # fmt: skip
        self.site, self.hints, self.has, self.layer, self.report, self.apply = site, hints, has, layer, report, apply
        self.n_has = n_has  # has.sum(), counted once by use_hints (no launch per call)
        self.routing = routing  # experts_hidden: [B * S, top_k], the rollout's expert of each slot

    def _check(self, tokens: int) -> None:
        if tokens != self.has.shape[0]:
            raise ValueError(
                f"use_hints: {self.site} of MoE layer {self.layer} got {tokens} tokens but the hints were laid out for "
                f"{self.has.shape[0]} (batch x sequence of the attention_mask); pass the mask of this forward."
            )

    def quantized(self, x: torch.Tensor, hints: fp4.FP4Hints, has: torch.Tensor, rows) -> fp4.FP4Tensor:
        """The codes of ``x`` (its rows: ``has``'s shape, then the row width): guided where a row has a hint, nearest
        elsewhere (`trace_hf.fp4.hinted_quantize`, one kernel on CUDA). ``rows``: how many rows have one."""
        with torch.no_grad():
            q, flips = fp4.hinted_quantize(x, hints, has.to(x.device), self.apply)
        # A flip: the nearest code (training scales) is not the code the rollout's hint selects (counted once per
        # forward: `MismatchReport.count` leaves out a checkpointed recompute).
        self.report.count(self.site, self.layer, flips, rows * x.shape[-1])
        return q

    def quantize(self, x: torch.Tensor, hints: fp4.FP4Hints, has: torch.Tensor, rows) -> torch.Tensor:
        """Fake-quantize ``x`` as `quantized` (its values, no codes written), straight-through in backward."""
        with torch.no_grad():
            y, flips = fp4.hinted_fake_quantize(x, hints, has.to(x.device), self.apply)
        self.report.count(self.site, self.layer, flips, rows * x.shape[-1])
        return fp4.straight_through(x, y)

    def experts_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [B * S, H], the MoE block's flattened input."""
        self._check(x.shape[0])
        return self.quantize(x, self.hints, self.has, self.n_has)

    def experts_input_codes(self, x: torch.Tensor) -> fp4.FP4Tensor:
        """`experts_input` as codes, for the fused kernels of frozen experts (`TraceFP4Experts`), which read them."""
        self._check(x.shape[0])
        return self.quantized(x, self.hints, self.has, self.n_has)

    def experts_hidden(self, h: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
        """``h`` [T, top_k, I] in (token, slot) order. A hint belongs to (token, expert): training's top-k slot of an
        expert takes the hint of the rollout's slot of the same expert; an expert the rollout did not route the token
        to has no hint."""
        self._check(h.shape[0])
        rec = self.routing.to(top_k_index.device)
        if rec.shape != top_k_index.shape:
            raise ValueError(
                f"use_hints: experts_hidden hints of MoE layer {self.layer} were recorded for top-k {rec.shape[1]}, "
                f"the router chose {top_k_index.shape[1]}; record and train the same model."
            )
        with torch.no_grad():
            match = top_k_index.unsqueeze(-1) == rec.unsqueeze(-2)  # [T, k (training slot), k (rollout slot)]
            src = match.long().argmax(-1)
            has = match.any(-1) & self.has.to(match.device).unsqueeze(-1)

            def take(t):
                idx = src.to(t.device).reshape(*src.shape, *([1] * (t.ndim - 2))).expand(*src.shape, *t.shape[2:])
                return torch.gather(t, 1, idx)

            hi = self.hints
            hints = fp4.FP4Hints(take(hi.mantissa_bits), take(hi.block_scale), take(hi.global_scale), hi.fmt)
        return self.quantize(h, hints, has.to(hints.mantissa_bits.device), has.sum())

    def kv(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``key``, ``value`` [B, kv_heads, S, D], as the attention function receives them."""
        b, heads, s, _ = key.shape
        self._check(b * s)
        x = torch.stack([key, value], dim=1).permute(0, 3, 1, 2, 4).flatten(0, 1)  # [B * S, 2, heads, D]
        has = self.has.to(x.device)[:, None, None].expand(-1, 2, heads)
        y = self.quantize(x, self.hints, has, self.n_has * 2 * heads).unflatten(0, (b, s)).permute(0, 2, 3, 1, 4)
        return y[:, 0].contiguous(), y[:, 1].contiguous()


def _positions(hint_batch: HintBatch, attention_mask: torch.Tensor):
    """Per padded column: the sample position it holds, and whether a hint exists there."""
    mask = attention_mask.to(torch.bool)
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    lengths = hint_batch.lengths.to(pos.device).unsqueeze(1)
    has = mask & (pos < lengths)
    return pos.clamp(max=max(hint_batch.routing.shape[1] - 1, 0)), has, mask


def _gather(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """t [B, L, ...], pos [B, S] -> [B * S, ...]."""
    idx = pos.to(t.device).reshape(*pos.shape, *([1] * (t.ndim - 2))).expand(*pos.shape, *t.shape[2:])
    return torch.gather(t, 1, idx).flatten(0, 1)


@contextlib.contextmanager
def use_hints(
    model: torch.nn.Module,
    hint_batch: HintBatch,
    attention_mask: torch.Tensor,
    routing_replay: bool = True,
    apply_hints: bool = True,
    align_positions: bool = True,
    packed: bool = False,
):
    """Apply hints (and optionally routing replay) to the training forwards inside the block.

    At hinted layers, tokens with a hint are quantized with the rollout's scales and recorded mantissa bits
    (`trace_hf.fp4.guided_quantize`); other tokens round to nearest. With ``routing_replay`` every MoE router
    takes the rollout's top-k ids, with weights from the training logits at those ids (so the router still
    learns). Keep the backward pass inside the block: gradient checkpointing recomputes the forward there.

    With ``apply_hints=False`` every token rounds to nearest (the "no hints" baseline) while the report still
    counts the flips the hints would have corrected. With ``align_positions`` a forward that passes no
    ``position_ids`` gets them from the attention mask
    (``cumsum - 1``), as `generate` computes them for left-padded prompts; TRL's training forward passes none,
    and the shifted rotary positions alone change the activations enough to flip many FP4 codes.

    With ``packed`` the forwards feed the rows' real tokens (the ones of ``attention_mask``) concatenated row after
    row into one sequence [1, N] (padding-free packing): every hint, recorded route and token check is the one of
    the [B, S] layout at the same (row, position), so each row meets its own hints wherever it is packed.

    Yields a `MismatchReport` that fills as forwards run.
    """
    if not isinstance(hint_batch, HintBatch):
        raise TypeError(
            f"use_hints needs the rollout's HintBatch, got {'None' if hint_batch is None else type(hint_batch).__name__}"
            ": the hints were not recorded (a rollout called with record=False, or generate outside a HintRecorder). "
            "Roll out with record=True (or generate inside `with HintRecorder(model) as rec:` and pass "
            "rec.collect(attention_mask)); for a training forward without hints, leave use_hints out "
            "(trace_hf.hints.aligned_positions still gives it generate's position ids)."
        )
    experts = fp4_experts(model)
    hinted = [m for m in experts if m.hinted]
    plan = plan_of(experts)
    inputs_hinted = [m for m in hinted if site_on(m, "experts_input")]
    b, s = attention_mask.shape
    if len(hint_batch) != b:
        raise ValueError(f"use_hints: {len(hint_batch)} hint rows for an attention_mask of {b} rows.")
    if tuple(m.moe_index for m in hinted) != tuple(hint_batch.hint_layers):
        raise ValueError(
            f"use_hints: hints were recorded at MoE layers {list(hint_batch.hint_layers)} but this model hints "
            f"{[m.moe_index for m in hinted]}; record and train with the same TraceFP4Config.hint_layers."
        )
    if tuple(plan) != hint_batch.sites:
        raise ValueError(
            f"use_hints: hints were recorded at sites {list(hint_batch.sites)} but this model hints {list(plan)}; "
            "record and train with the same TraceFP4Config.hint_sites."
        )
    if hinted and hint_batch.fmt != hinted[0].fmt:
        raise ValueError(
            f"use_hints: the hints are {hint_batch.fmt} but this model's experts are {hinted[0].fmt}; record and train "
            "with the same TraceFP4Config.fmt."
        )
    routers = routers_of(model, experts)
    if routing_replay:
        for router in routers:
            check_replayable(router)
    if inputs_hinted and hint_batch.width != hinted[0].hidden_dim:
        raise ValueError(f"use_hints: hints of width {hint_batch.width} for experts of width {hinted[0].hidden_dim}.")
    if hint_batch.routing.shape[2] != len(experts):
        raise ValueError(
            f"use_hints: routing recorded for {hint_batch.routing.shape[2]} MoE layers, the model has {len(experts)}."
        )
    if experts and not model.training:
        raise RuntimeError(
            "use_hints guides the training (QAT) forward, but the model is in eval mode, where the experts run the "
            "rollout path and would apply no hint. Call model.train() inside the block (or leave use_hints out for "
            "an eval forward)."
        )
    pos, has, mask = _positions(hint_batch, attention_mask)
    n_has = int(has.sum())
    report = MismatchReport(
        hinted_tokens=n_has if hinted else 0,
        real_tokens=int(mask.sum()),
        hint_bytes_per_token=hint_batch.bytes_per_token(),
    )
    # The forward's tokens, flattened: every [B * S] column, or (packed) its real ones in the same order.
    real = mask.flatten().nonzero().flatten() if packed else None

    def tokens(t: torch.Tensor) -> torch.Tensor:
        return t if real is None else t[real.to(t.device)]

    has_flat = tokens(has.flatten())
    handles, guided = [], []
    try:
        for site in plan:
            for j, layer in enumerate(plan[site]):
                bits, scales, gscale = (tokens(_gather(t[:, :, j], pos)) for t in hint_batch.site(site))
                hints = fp4.FP4Hints(bits, scales, gscale.unsqueeze(-1), hint_batch.fmt)
                m = experts[layer]
                routing = None
                if site == "experts_hidden":
                    if hints.width != m.intermediate_dim:
                        raise ValueError(
                            f"use_hints: experts_hidden hints of width {hints.width} for experts of intermediate "
                            f"size {m.intermediate_dim}; record and train the same model."
                        )
                    routing = tokens(_gather(hint_batch.routing[:, :, layer], pos)).long()
                point = m.sites[site]
                point.guide = Guide(site, hints, has_flat.to(bits.device), n_has, layer, report, apply_hints, routing)
                guided.append(point)
        if align_positions:
            handles.append(_register_position_hook(model, attention_mask, packed))
        if hint_batch.token_ids is not None:
            handles.append(_register_token_check(model, hint_batch.token_ids, pos, has, mask if packed else None))
        for m, router in zip(experts, routers, strict=True):
            recorded = tokens(_gather(hint_batch.routing[:, :, m.moe_index], pos)).long()
            hook = routing_hook(recorded, has_flat, routing_replay, report, n_has)
            handles.append(router.register_forward_hook(hook))
        yield report
        _warn_if_off_policy(model, report)
    finally:
        for point in guided:
            point.guide = None
        for h in handles:
            h.remove()


def _register_token_check(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    pos: torch.Tensor,
    has: torch.Tensor,
    packed_mask: torch.Tensor | None = None,
):
    """Every forward inside `use_hints` must feed, at each hinted position, the token the rollout fed there."""
    want = torch.gather(token_ids, 1, pos.to(token_ids.device))
    if packed_mask is not None:  # the packed forward's [1, N] tokens: the real columns, row after row
        real = packed_mask.to(want.device)
        want, has = want[real].unsqueeze(0), has.to(want.device)[real].unsqueeze(0)

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or ids.shape != want.shape:
            return None
        bad = ((ids.to(want.device) != want) & has.to(want.device)).sum()
        if int(bad):
            raise ValueError(
                f"use_hints: at {int(bad)} of {int(has.sum())} hinted positions the forward's tokens differ from "
                "the ones the rollout recorded: the hint rows belong to other sequences, are permuted against "
                "these rows, or the attention_mask does not mark these rows' real tokens. Pass hint_batch[rows] "
                "with the same rows, in the same order, and their own attention mask."
            )
        return None

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids as `generate` makes them for left-padded prompts: ``cumsum(mask) - 1``, pads at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _register_position_hook(model: torch.nn.Module, attention_mask: torch.Tensor, packed: bool = False):
    def hook(module, args, kwargs):
        if kwargs.get("position_ids") is None:
            mask = kwargs.get("attention_mask")
            mask = attention_mask if mask is None else mask
            pos = position_ids_from_mask(mask)
            pos = pos[mask.bool()].unsqueeze(0) if packed else pos  # packed: each row's own, restarting at 0
            kwargs["position_ids"] = pos.to(mask.device)
        return args, kwargs

    return model.register_forward_pre_hook(hook, with_kwargs=True)


@contextlib.contextmanager
def aligned_positions(model: torch.nn.Module, attention_mask: torch.Tensor, packed: bool = False):
    """Forwards inside get ``position_ids`` from the attention mask when they pass none, as `generate` does.

    TRL's training forward passes none, so left-padded rows would otherwise see rotary positions shifted by their
    padding, in every regime (BF16 included), and compute other activations than the rollout did. With ``packed``
    (the rows' real tokens fed as one sequence, as `use_hints`) the positions restart at each row.
    """
    handle = _register_position_hook(model, attention_mask, packed)
    try:
        yield
    finally:
        handle.remove()
