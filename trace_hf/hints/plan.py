# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Which MoE layers are hinted at which site: the plan that recording and replay both follow."""

from __future__ import annotations

import torch

from ..quant.config import HINT_SITES
from ..quant.experts import TraceFP4Experts, fp4_experts


def site_on(m: TraceFP4Experts, site: str) -> bool:
    """Whether MoE layer `m` is hinted at `site`: the quantizer installed that `HintSite` on it."""
    return site in HINT_SITES and site in m.sites


def hint_plan(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The MoE layers hinted at each site, sites in `HINT_SITES` order; a site with no layer is left out (e.g. "kv"
    where every hinted decoder layer has linear attention, which caches no K/V)."""
    return plan_of(fp4_experts(model))


def plan_of(experts: list[TraceFP4Experts]) -> dict[str, tuple[int, ...]]:
    """`hint_plan` from the model's FP4 experts in MoE-layer order (for callers that hold them already)."""
    plan = {site: tuple(m.moe_index for m in experts if site_on(m, site)) for site in HINT_SITES}
    return {site: layers for site, layers in plan.items() if layers}


# ----------------------------------------------------------------------------------------------------------
# HintBatch: per-row tensors keyed by sample and token position
# ----------------------------------------------------------------------------------------------------------
