# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`MismatchReport`: what the hints corrected in training, and the warning for hints of another policy."""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass, field, fields

import torch

from ..quant.config import HINT_SITES


def recomputing() -> bool:
    """Whether this forward runs inside autograd's backward: gradient checkpointing recomputing a forward whose
    tokens were counted when it first ran (so the counts are those of the forwards, checkpointed or not)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class MismatchReport:
    """What the hints corrected in one `use_hints` block (counts accumulate over its forwards).

    ``hint_flip_rate``: at hinted sites and tokens, the fraction of elements whose nearest rounding (training
    scales) differs from the hint-guided value, i.e. the flips the hints corrected; over every site, and per site
    and MoE layer in `flip_rate_by_site` / `flip_rate_by_layer`. ``flips`` / ``elements`` count per ``(site, MoE
    layer)`` (for "kv" the MoE layer of the same decoder layer). ``routing_mismatch``: the fraction of (token, MoE
    layer) pairs whose own top-k set differs from the rollout's. ``hint_coverage``: the fraction of real tokens that
    had hints.
    """

    flips: dict[tuple[str, int], int] = field(default_factory=dict)
    elements: dict[tuple[str, int], int] = field(default_factory=dict)
    routing_diff: int = 0
    routing_total: int = 0
    hinted_tokens: int = 0
    real_tokens: int = 0
    hint_bytes_per_token: int = 0

    # A rate over zero elements is NaN, never a perfect 0: nothing was checked.
    @property
    def hint_flip_rate(self) -> float:
        n = self.total_elements
        return self.total_flips / n if n else math.nan

    def count(self, site: str, layer: int, flips, elements) -> None:
        """Add one guided quantization's counts (tensors are fine: they are summed lazily, with no host sync); a
        checkpointed recompute's are left out (`recomputing`)."""
        if recomputing():
            return
        key = (site, layer)
        self.flips[key] = _add(self.flips.get(key, 0), flips)
        self.elements[key] = _add(self.elements.get(key, 0), elements)

    def count_routing(self, diff, total) -> None:
        """Add one router's counts: ``diff`` of its ``total`` hinted tokens chose another top-k set (lazily, as
        `count`)."""
        if recomputing():
            return
        self.routing_diff = _add(self.routing_diff, diff)
        self.routing_total = _add(self.routing_total, total)

    def flip_rate_by_layer(self, site: str = "experts_input") -> dict[int, float]:
        keys = sorted(k for k in self.elements if k[0] == site)
        return {
            k[1]: float(self.flips.get(k, 0)) / int(self.elements[k]) if self.elements[k] else math.nan for k in keys
        }

    def counts_by_site(self) -> dict[str, tuple[int, int]]:
        """(flips, elements) per site, in `HINT_SITES` order."""
        out = {}
        for (site, layer), n in self.elements.items():
            f, e = out.get(site, (0, 0))
            out[site] = (f + int(self.flips.get((site, layer), 0)), e + int(n))
        return {s: out[s] for s in HINT_SITES if s in out}

    def flip_rate_by_site(self) -> dict[str, float]:
        return {s: f / e if e else math.nan for s, (f, e) in self.counts_by_site().items()}

    @property
    def routing_mismatch(self) -> float:
        return float(self.routing_diff) / self.routing_total if self.routing_total else math.nan

    @property
    def hint_coverage(self) -> float:
        return self.hinted_tokens / self.real_tokens if self.real_tokens else math.nan

    def as_metrics(self, prefix: str = "trace/") -> dict[str, float]:
        return {
            f"{prefix}hint_flip_rate": self.hint_flip_rate,
            **{f"{prefix}hint_flip_rate/{s}": r for s, r in self.flip_rate_by_site().items()},
            f"{prefix}routing_mismatch": self.routing_mismatch,
            f"{prefix}hint_coverage": self.hint_coverage,
            f"{prefix}hint_bytes_per_token": float(self.hint_bytes_per_token),
        }

    @classmethod
    def merged(cls, reports) -> MismatchReport:
        """One report with the counts of all `reports` (e.g. the forwards of every micro-batch of a step)."""
        out = cls()
        for r in reports:
            out.merge(r)
        return out

    @property
    def total_flips(self) -> int:
        return int(sum(int(v) for v in self.flips.values()))

    @property
    def total_elements(self) -> int:
        return int(sum(int(v) for v in self.elements.values()))

    def merge(self, other: MismatchReport) -> None:
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, dict):
                for k, v in b.items():
                    a[k] = a.get(k, 0) + v
            elif f.name != "hint_bytes_per_token":
                setattr(self, f.name, a + b)
        self.hint_bytes_per_token = other.hint_bytes_per_token or self.hint_bytes_per_token


def _add(total, n):
    """``total + n``, without a device launch for the first tensor added to a count that is still 0."""
    return n if isinstance(total, int) and total == 0 else total + n


class StaleHintsWarning(UserWarning):
    """Hints applied to a model that disagrees with them far more than the policy that recorded them would."""


# Thresholds of the off-policy warning, from `python -m benchmarks.mismatch.stale_hints` (tiny Qwen3 MoE, CPU,
# BF16; 3 seeds) and the GPU runs of docs/results.md: a rollout of the same policy shows flip rates of 0.08 (CPU) to
# 0.19 (H200, QAT without hints) and routing mismatch of 0.02 to 0.22 (H200, naive FP4); another policy of the same
# shape 0.57 and 0.95, and weights moved 10% 0.48 and 0.37. Warn at about twice the largest same-policy rate.
STALE_FLIP_RATE = 0.40
STALE_ROUTING_MISMATCH = 0.50
_STALE_MIN_ELEMENTS, _STALE_MIN_ROUTES = 4096, 64  # fewer: too noisy to call
_STALE_WARNED: weakref.WeakSet = weakref.WeakSet()  # models warned already: once per model


def _warn_if_off_policy(model: torch.nn.Module, report: MismatchReport) -> None:
    if model in _STALE_WARNED:
        return
    flips, elements, diff = _host_values(sum(report.flips.values(), 0), sum(report.elements.values(), 0),
                                         report.routing_diff)  # fmt: skip
    flips = flips / elements if elements >= _STALE_MIN_ELEMENTS else 0.0
    routing = diff / report.routing_total if report.routing_total >= _STALE_MIN_ROUTES else 0.0
    if not (flips >= STALE_FLIP_RATE or routing >= STALE_ROUTING_MISMATCH):
        return
    _STALE_WARNED.add(model)
    warnings.warn(
        f"use_hints: the hints disagree with this model far more than a rollout of the same policy does (flip rate "
        f"{flips:.2f}, routing mismatch {routing:.2f}; the same policy shows at most about 0.19 and 0.22, another "
        f"policy 0.57 and 0.95): the rollout that recorded them ran other weights. Stale or asynchronous rollouts "
        "(a max_version_diff above 0, a weight sync that has not reached the rollout) make hints off-policy, and "
        "guiding training with them adds error instead of removing it. Roll out with the weights being trained. "
        f"(Warned once per model; thresholds trace_hf.hints.STALE_FLIP_RATE={STALE_FLIP_RATE}, "
        f"STALE_ROUTING_MISMATCH={STALE_ROUTING_MISMATCH}.)",
        StaleHintsWarning,
        stacklevel=4,  # the caller's `with use_hints(...)` (past this function, the generator and contextlib)
    )


def _host_values(*values) -> list[float]:
    """Counts that may be device tensors (summed lazily, `MismatchReport.count`) as floats, in one host sync: the
    trainer checks every forward's report, and a sync per count would make that cost grow with the hinted layers."""
    dev = next((v.device for v in values if torch.is_tensor(v)), None)
    if dev is None:
        return [float(v) for v in values]
    return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=dev) for v in values]).tolist()
