# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`HintSite`: the one declared object per (site, MoE layer) through which rollout records and training guides.

Why: MoE blocks and attention wrappers receive no forward kwargs from the trainer, so whatever records or guides a
quantization point has to be found from the module that quantizes. The quantizer installs one `HintSite` per
(site, layer) when it marks the hinted layers (`experts.assign_hint_layers`): on the experts module of that layer
(``experts.sites``), and, for "kv", bound to the attention module of the same decoder layer (`attention_site`) and
handed to its FP4 cache layer. `trace_hf.hints.HintRecorder` sets ``recorder`` for the length of a rollout and
`trace_hf.hints.use_hints` sets ``guide`` for the length of a training forward; both are None otherwise.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from torch import nn


#: Sites that carry hints; "routing" (every MoE layer's top-k, recorded for replay) is a site without hints.
HINTED_SITES = ("experts_input", "experts_hidden", "kv")


@dataclass(eq=False)
class HintSite:
    """One quantization point: `site` of MoE layer `moe_layer` (decoder layer `decoder_layer`).

    Attributes:
        recorder: the `HintRecorder` recording a rollout now, or None.
        guide: the `trace_hf.hints.replay.Guide` of the training forward now (hinted sites only), or None.
    """

    site: str
    moe_layer: int
    decoder_layer: int | None = None
    recorder: Any = None
    guide: Any = None


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
