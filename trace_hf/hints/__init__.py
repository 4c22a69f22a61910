# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Record hints and routing at rollout, replay them in training, and measure the mismatch that is left.

Usable from any RL loop::

    with HintRecorder(model) as rec:                       # model.eval(), FP4 rollout path
        out = model.generate(**prompts, max_new_tokens=...)
    hints = rec.collect(attention_mask)                    # keyed by (sample, token position)
    ...
    with use_hints(model, hints[rows], attention_mask[rows]) as report:   # model.train()
        loss = compute_loss(model(...)); loss.backward()   # keep backward inside: checkpointing recomputes

A hint row is what `trace_hf.fp4.extract_hints` keeps of one FP4 row: its mantissa bits, block-scale bytes and fp32
row scale (docs/numerics.md, hints section). `TraceFP4Config.hint_sites` picks the rows: each token's experts input
("experts_input", the default), each routed expert's down-projection input per token and top-k slot
("experts_hidden"), and the FP4 K and V per token and KV head ("kv").

The modules follow the data: `plan` (which layers are hinted where), `record` (`HintRecorder`), `batch`
(`HintBatch`, the per-sample layout every rollout path produces), `replay` (`use_hints` and its guides), `routing`
(routing replay), `report` (`MismatchReport`, the stale-hints warning) and `sizes` (bytes per token from a config).
"""

from .batch import EXTRA_SITES, HintBatch, hint_batch_from_columns, kv_rows
from .plan import hint_plan
from .record import HintRecorder
from .replay import aligned_positions, position_ids_from_mask, use_hints
from .report import STALE_FLIP_RATE, STALE_ROUTING_MISMATCH, MismatchReport, StaleHintsWarning
from .sizes import hint_bytes_per_token, hint_bytes_per_token_by_site


__all__ = [
    "EXTRA_SITES",
    "STALE_FLIP_RATE",
    "STALE_ROUTING_MISMATCH",
    "HintBatch",
    "HintRecorder",
    "MismatchReport",
    "StaleHintsWarning",
    "aligned_positions",
    "hint_batch_from_columns",
    "hint_bytes_per_token",
    "hint_bytes_per_token_by_site",
    "hint_plan",
    "kv_rows",
    "position_ids_from_mask",
    "use_hints",
]
