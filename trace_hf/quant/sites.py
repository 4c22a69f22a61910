# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`HintSite`: the one declared object per (site, MoE layer) through which rollout records and training guides.

Why: MoE blocks and attention wrappers receive no forward kwargs from the trainer, so whatever records or guides a
quantization point has to be found from the module that quantizes. The quantizer installs one `HintSite` per
(site, layer) when it marks the hinted layers (`experts.assign_hint_layers`): on the experts module of that layer
(``experts.sites``), and, for "kv", bound to the attention module of the same decoder layer (`attention_site`) and
handed to its FP4 cache layer. `trace_hf.hints.HintRecorder` sets ``recorder`` for the length of a rollout and
`trace_hf.hints.use_hints` sets ``guide`` for the length of a training forward; both are None otherwise.

`SiteRecorder` and `SiteGuide` declare every call the layers make on a recorder and a guide: this floor calls only
what it declares here and imports nothing from `trace_hf.hints`, which implements them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from .. import fp4


#: Sites that carry hints; "routing" (every MoE layer's top-k, recorded for replay) is a site without hints.
HINTED_SITES = ("experts_input", "experts_hidden", "kv")


class SiteRecorder(Protocol):
    """What a rollout's eval forward hands a recorder (`trace_hf.hints.HintRecorder`), per site."""

    def record_input(self, site: HintSite, q: fp4.FP4Tensor, hints: fp4.FP4Hints | None = None) -> None:
        """The experts' quantized input [T, H]; ``hints``: as its quantization wrote them, else None."""

    def record_hidden(
        self, site: HintSite, q: fp4.FP4Tensor, inverse: torch.Tensor, top_k: int, hints: fp4.FP4Hints | None = None
    ) -> None:
        """The quantized down-projection input, rows sorted by expert; ``inverse`` [T * k]: each (token, slot)'s
        row."""

    def record_kv(self, site: HintSite, qk: fp4.FP4Tensor, qv: fp4.FP4Tensor) -> None:
        """What the FP4 cache of the site's decoder layer quantized, [B, kv_heads, s, ...]."""

    def record_routing(self, site: HintSite, top_k_index: torch.Tensor) -> None:
        """The router's top-k expert ids [T, top_k]."""


class SiteGuide(Protocol):
    """What a training forward asks of a guide (`trace_hf.hints.replay.Guide`): the site's values rounded as the
    rollout rounded them."""

    def experts_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [B * S, H] fake-quantized."""

    def experts_input_codes(self, x: torch.Tensor) -> fp4.FP4Tensor:
        """``x`` [B * S, H] as codes, for the fused kernels of frozen experts."""

    def experts_hidden(self, h: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
        """``h`` [T, top_k, I] fake-quantized, in (token, slot) order of the router's ``top_k_index``."""

    def kv(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``key``, ``value`` [B, kv_heads, S, D] fake-quantized."""


@dataclass(eq=False)
class HintSite:
    """One quantization point: `site` of MoE layer `moe_layer` (decoder layer `decoder_layer`).

    Attributes:
        recorder: the recorder of the rollout now, or None.
        guide: the guide of the training forward now (hinted sites only), or None.
    """

    site: str
    moe_layer: int
    decoder_layer: int | None = None
    recorder: SiteRecorder | None = None
    guide: SiteGuide | None = None


# attention module -> the "kv" HintSite of its decoder layer. Kept here rather than on the module: the attention
# wrapper (`kv_cache.install_kv_fake_quant`) is a registered function that receives only the module.
_ATTENTION_SITES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def bind_attention(attention: nn.Module, site: HintSite | None) -> None:
    if site is None:
        _ATTENTION_SITES.pop(attention, None)
    else:
        _ATTENTION_SITES[attention] = site


def attention_site(attention: nn.Module) -> HintSite | None:
    """The "kv" site of an attention module (None: its K/V carry no hints)."""
    return _ATTENTION_SITES.get(attention)
