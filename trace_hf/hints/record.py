# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Recording: `HintRecorder` keeps, during a rollout, the hints of every hinted site and the routing of every MoE
layer."""

from __future__ import annotations

import weakref

import torch

from .. import fp4
from ..quant.experts import fp4_experts
from ..quant.kv_cache import FP4KVLayer
from ..quant.sites import HintSite, SiteRecorder
from .batch import EXTRA_SITES, HintBatch, hint_batch_from_columns, kv_rows
from .plan import hint_plan


class HintRecorder(SiteRecorder):
    """Records, during `generate` (or any eval forward), the hints of every token the rollout computed at the
    hinted MoE layers and sites (`TraceFP4Config.hint_sites`), and the routed top-k expert ids of every MoE layer.
    The layers call it through `SiteRecorder`, the interface the quant floor declares.

    Args:
        model: a model loaded with `TraceFP4Config` (its experts are `TraceFP4Experts`), in eval mode.
        storage: ``"device"`` keeps records where they were computed; ``"cpu"`` moves them to (pinned, when CUDA
            is present) CPU memory as they are made.
    """

    def __init__(self, model: torch.nn.Module, storage: str = "device"):
        if storage not in ("device", "cpu"):
            raise ValueError(f"HintRecorder storage={storage!r}: use 'device' or 'cpu'.")
        self.model = model
        self.storage = storage
        self.experts = fp4_experts(model)
        if not self.experts:
            raise ValueError(
                "HintRecorder needs a model loaded with quantization_config=TraceFP4Config(); this one has no FP4 "
                "experts."
            )
        self.fmt = self.experts[0].fmt
        self.hint_layers = tuple(m.moe_index for m in self.experts if m.hinted)
        self.plan = hint_plan(model)
        self._input_layers = self.plan.get("experts_input", ())
        self._sites = [site for m in self.experts for site in m.sites.values()]
        # "kv": decoder layer of the FP4 cache -> its HintSite (bound to the cache layers a forward passes).
        self._kv_sites = {site.decoder_layer: site for site in self._sites if site.site == "kv"}
        self._watched: weakref.WeakSet = weakref.WeakSet()
        self._site_records: dict[str, dict[int, list]] = {}
        self._steps: list[tuple[int, int]] = []
        self._ids: list[torch.Tensor | None] = []
        self._reordered = False
        self._inputs: dict[int, list] = {}
        self._routing: dict[int, list] = {}
        self._hook = None

    def __enter__(self) -> HintRecorder:
        if self.model.training:
            raise RuntimeError("HintRecorder records the FP4 rollout path: call model.eval() before recording.")
        self._steps.clear()
        self._ids.clear()
        self._reordered = False
        self._inputs = {i: [] for i in self.hint_layers}
        self._routing = {m.moe_index: [] for m in self.experts}
        self._site_records = {site: {i: [] for i in self.plan[site]} for site in EXTRA_SITES if site in self.plan}
        self._hook = self.model.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        for site in self._sites:
            site.recorder = self
        return self

    def __exit__(self, *exc) -> None:
        self._hook.remove()
        for site in self._sites:
            site.recorder = None

    def _on_forward(self, module, args, kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        self._ids.append(None if x is None else self._store(x.to(torch.int32)))
        if x is None:
            x = kwargs["inputs_embeds"]
        self._steps.append((x.shape[0], x.shape[1]))
        for name in ("cache", "past_key_values"):
            cache = kwargs.get(name)
            if cache is not None and hasattr(cache, "reorder_cache") and cache not in self._watched:
                self._watch(cache)
            if cache is not None and self._kv_sites:
                self._bind_kv(cache)

    def _bind_kv(self, cache) -> None:
        """The FP4 cache layers of "kv"-hinted decoder layers call `record_kv` with what they quantize."""
        for j, layer in enumerate(getattr(cache, "layers", ())):
            if j in self._kv_sites and isinstance(layer, FP4KVLayer):
                layer.site = self._kv_sites[j]

    def _watch(self, cache) -> None:
        """Beam search reorders the cache's rows between steps; the recorded columns would then mix beams. No public
        hook tells a forward hook that generate reordered its beams, so this cache instance's `reorder_cache` is
        wrapped (the original is called) for as long as the cache lives."""
        self._watched.add(cache)
        original = cache.reorder_cache

        def reorder_cache(beam_idx, *a, **kw):
            self._reordered = True
            return original(beam_idx, *a, **kw)

        cache.reorder_cache = reorder_cache

    def _store(self, t: torch.Tensor) -> torch.Tensor:
        if self.storage == "cpu" and t.device.type != "cpu":
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)
        return t

    def _shape(self, t: torch.Tensor) -> torch.Tensor:
        b, s = self._steps[-1]
        if t.shape[0] != b * s:
            raise RuntimeError(
                f"HintRecorder saw {t.shape[0]} tokens at an MoE layer but the forward had batch {b} x {s}; "
                "record only forwards of the recorded model."
            )
        return t.reshape(b, s, *t.shape[1:])

    def record_input(self, site: HintSite, q: fp4.FP4Tensor, hints: fp4.FP4Hints | None = None) -> None:
        """The experts' quantized input ``q`` [T, H]; ``hints``: its hints as its quantization wrote them
        (`fp4.quantize_with_hints`), else extracted from the codes."""
        h = fp4.extract_hints(q) if hints is None else hints
        rec = (h.mantissa_bits, h.block_scale, h.global_scale.reshape(-1))
        self._inputs[site.moe_layer].append(tuple(self._store(self._shape(t)) for t in rec))

    def record_hidden(
        self, site: HintSite, q: fp4.FP4Tensor, inverse: torch.Tensor, top_k: int, hints: fp4.FP4Hints | None = None
    ) -> None:
        """The quantized down-projection input, rows sorted by expert (``q`` [T * k, I] in the torch path, the fused
        kernels' padded [P, I]); ``inverse`` [T * k] is each (token, slot)'s row. Kept per token and slot.
        ``hints``: ``q``'s, as its quantization wrote them (the fused kernels' `QuantizedHidden.hints`): their rows
        are kept as they are, the bits `fp4.extract_hints` would take from the codes, without unpacking them."""
        if hints is None:
            fields, fmt = (q.packed, q.block_scale, q.global_scale), q.fmt
        else:
            fields, fmt = (hints.mantissa_bits, hints.block_scale, hints.global_scale), hints.fmt
        rows = (t[inverse].unflatten(0, (-1, top_k)) for t in fields)
        h = fp4.extract_hints(fp4.FP4Tensor(*rows, fmt)) if hints is None else fp4.FP4Hints(*rows, fmt)
        self._record_hints("experts_hidden", site.moe_layer, h)

    def record_kv(self, site: HintSite, qk: fp4.FP4Tensor, qv: fp4.FP4Tensor) -> None:
        """What the FP4 cache of the site's decoder layer quantized ([B, kv_heads, s, ...]); kept per token as
        [2 (K, V), kv_heads, ...]."""
        self._record_site("kv", site.moe_layer, kv_rows(qk, qv))

    def _record_site(self, site: str, layer: int, rows: fp4.FP4Tensor) -> None:
        """Hints of one forward at `site` of MoE layer `layer`; ``rows`` has the forward's tokens on dim 0."""
        self._record_hints(site, layer, fp4.extract_hints(rows))

    def _record_hints(self, site: str, layer: int, h: fp4.FP4Hints) -> None:
        rec = (h.mantissa_bits, h.block_scale, h.global_scale.squeeze(-1))
        self._site_records[site][layer].append(tuple(self._store(self._shape(t)) for t in rec))

    def record_routing(self, site: HintSite, top_k_index: torch.Tensor) -> None:
        self._routing[site.moe_layer].append(self._store(self._shape(top_k_index.to(torch.int16))))

    def columns(self) -> tuple[torch.Tensor, ...]:
        """The recorded forwards as per-column tensors [B, cols, n_layers, ...] (bits, block scales, row scales of
        the hinted layers; routing of every MoE layer; the fed token ids [B, cols] or None), column ``j`` being the
        ``j``-th fed position of the padded batch. Checks that the forwards are one cached decode: a prefill, then one column per step."""
        if not self._steps:
            raise RuntimeError(
                "HintRecorder recorded nothing: no forward of this model ran inside the `with` block. Run generate "
                "(or a forward) inside it, with the model in eval(); a generate that does not run the model (replaced "
                "or mocked) has no hints to record."
            )
        if self._reordered:
            raise RuntimeError(
                "HintRecorder saw beam search reorder the batch between steps, so the recorded hints mix beams. "
                "Hints are recorded from sampled rollouts: generate with num_beams=1 (do_sample=True)."
            )
        b = self._steps[0][0]
        if any(sb != b for sb, _ in self._steps):
            raise RuntimeError(
                f"HintRecorder saw forwards of batch sizes {sorted({sb for sb, _ in self._steps})}: it records one "
                "batch. Beam search and other batch-reshaping strategies are not supported; sample instead."
            )
        if any(s_ != 1 for _, s_ in self._steps[1:]):
            raise RuntimeError(
                "HintRecorder saw a multi-token forward after the first one: either generate(use_cache=False), which "
                "re-feeds the whole sequence each step, or several generate calls inside one recorder. Generate with "
                "use_cache=True, and use one `with HintRecorder(...)` block (and one collect) per generate call."
            )

        def cat(parts):
            return torch.cat(parts, dim=1)

        def stack(per_layer):
            return torch.stack([cat(p) for p in per_layer], dim=2)

        routing = stack([self._routing[m.moe_index] for m in self.experts])
        ids = None if any(t is None for t in self._ids) else cat(self._ids)
        if not self._input_layers:  # no experts_input hints: empty hint tensors keep the batch layout uniform
            h, bs = self.experts[0].hidden_dim, fp4.get_format(self.fmt).block_size
            cols = routing.shape[1]
            return (
                routing.new_zeros((b, cols, 0, h // 8), dtype=torch.uint8),
                routing.new_zeros((b, cols, 0, h // bs), dtype=torch.uint8),
                routing.new_zeros((b, cols, 0), dtype=torch.float32),
                routing,
                ids,
            )
        parts = [[[p[k] for p in self._inputs[i]] for i in self._input_layers] for k in range(3)]
        return (*(stack(p) for p in parts), routing, ids)

    def site_columns(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The other sites' records as per-column tensors [B, cols, n_layers, ...] (bits, block scales, row scales),
        laid out as `columns`."""
        out = {}
        for site, layers in self._site_records.items():
            for i, recs in layers.items():
                if len(recs) != len(self._steps):
                    where = f"the FP4 K/V of decoder layer {self.experts[i].kv_layer}" if site == "kv" else site
                    raise RuntimeError(
                        f"HintRecorder saw {len(self._steps)} forwards but recorded {where} in {len(recs)}: the 'kv' "
                        "site records what the FP4 KV cache writes (TraceFP4Config(kv_cache=...), generate's own "
                        "cache); do not pass a cache of another type, or drop the site from hint_sites."
                    )
            out[site] = tuple(
                torch.stack([torch.cat([r[k] for r in layers[i]], dim=1) for i in layers], dim=2) for k in range(3)
            )
        return out

    def collect(
        self, attention_mask: torch.Tensor, rows: torch.Tensor | None = None, then: tuple | None = None
    ) -> HintBatch:
        """Turn the recorded forwards into a `HintBatch`: the one assembly of every rollout path, so `generate`
        and the engine lay hints out alike.

        Args:
            attention_mask: [B, N] mask of the whole sequences (prompt and completion, left-padded prompts), e.g.
                the prompt mask concatenated with the completion mask. Column ``j`` with mask 1 is the next
                position of its sample. Columns the rollout never fed through the model (the last generated token)
                get no hint.
            rows: [B], the recorded row that holds sample ``b``'s columns (the engine prefills each distinct prompt
                once); None: row ``b``.
            then: columns recorded outside the model's forwards, appended after the recorded ones (the engine's
                decode steps): (bits, block scales, row scales, routing, token ids, {site: (bits, block scales, row
                scales)}), laid out as `columns` and `site_columns`.
        """
        *cols, ids = self.columns()
        sites = self.site_columns()
        if rows is not None:
            cols, ids = [t[rows] for t in cols], None if ids is None else ids[rows]
            sites = {site: tuple(t[rows] for t in ts) for site, ts in sites.items()}
        if then is not None:
            *more, more_ids, more_sites = then

            def cat(a, b):  # b may sit in CPU memory (the engine's streamed records): assemble there
                return [torch.cat([x.to(y.device), y], dim=1) for x, y in zip(a, b, strict=True)]

            cols, ids = cat(cols, more), torch.cat([ids.to(more_ids.device), more_ids.to(ids.dtype)], dim=1)
            sites = {site: tuple(cat(ts, more_sites[site])) for site, ts in sites.items()}
        return hint_batch_from_columns(*cols, attention_mask, self.fmt, self.hint_layers, ids, site_columns=sites)
