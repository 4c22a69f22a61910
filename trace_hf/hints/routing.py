# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Routing replay: the training router takes the rollout's top-k experts, weighted from its own logits."""

from __future__ import annotations

import torch

from ..models import is_softmax_topk_router
from .report import MismatchReport, recomputing


def check_replayable(router: torch.nn.Module) -> None:
    if not is_softmax_topk_router(router):
        raise ValueError(
            f"Routing replay recomputes the routing weights as a softmax top-k (the Qwen MoE routers); "
            f"{type(router).__name__} may weight its experts another way. Set routing_replay=False."
        )


def routing_hook(recorded: torch.Tensor, has: torch.Tensor, replay: bool, report: MismatchReport, n_has: int):
    """The router's forward hook: counts (and with ``replay`` replaces) its top-k against ``recorded`` at the
    ``has`` tokens (``n_has`` of them, counted once by the caller: a host sync per hook would stall every layer)."""
    recorded_set = recorded.sort(-1).values  # once, not at every call (the forward and its checkpointed recompute)

    def hook(router, args, output):
        logits, scores, indices = output
        if indices.shape != recorded.shape:
            raise ValueError(
                f"use_hints: the router saw {tuple(indices.shape)} (tokens, top_k) but routing was recorded as "
                f"{tuple(recorded.shape)} for this batch."
            )
        rec = recorded.to(indices.device)
        mask = has.to(indices.device)
        if not recomputing():  # a checkpointed recompute routes as the forward did, which was counted
            with torch.no_grad():
                same = (indices.sort(-1).values == recorded_set.to(indices.device)).all(-1)
                report.count_routing((same < mask).sum(), n_has)  # hinted tokens (mask) whose set is not the same
        if not replay:
            return output
        idx = torch.where(mask.unsqueeze(-1), rec, indices)
        probs = torch.softmax(logits.float(), dim=-1)
        w = probs.gather(-1, idx)
        if getattr(getattr(router, "base_layer", router), "norm_topk_prob", True):
            w = w / w.sum(-1, keepdim=True)
        return logits, w.to(scores.dtype), idx

    return hook


# ----------------------------------------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------------------------------------
