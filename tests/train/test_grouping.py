# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`trace_hf.train.grouping.group_by_length` on TRL-shaped micro-batches; the trainer side is in test_trainer.py."""

from __future__ import annotations

import torch

from trace_hf.train.grouping import group_by_length


def _batches(lengths, prompt=3):
    """TRL-shaped micro-batches of two rows: masks with the given completion lengths, a per-row tensor, a list, a
    scalar."""
    n, width = len(lengths), max(lengths)
    comp = torch.zeros(n, width, dtype=torch.long)
    for r, c in enumerate(lengths):
        comp[r, :c] = 1
    rows = {"prompt_mask": torch.ones(n, prompt, dtype=torch.long), "completion_mask": comp,
            "row": torch.arange(n), "names": [f"r{r}" for r in range(n)], "num_items_in_batch": torch.tensor(99)}  # fmt: skip
    out = []
    for s in range(0, n, 2):
        out.append({k: v if k == "num_items_in_batch" else v[s : s + 2] for k, v in rows.items()})
    return out


def test_rows_are_regrouped_shortest_first_and_keep_their_columns():
    lengths = [5, 1, 4, 2, 6, 3]
    out = group_by_length(_batches(lengths))
    assert len(out) == 3 and all(len(b["row"]) == 2 for b in out)
    order = torch.cat([b["row"] for b in out]).tolist()
    assert order == [1, 3, 5, 2, 0, 4]  # by length 1, 2, 3, 4, 5, 6
    for b in out:
        assert b["names"] == [f"r{r}" for r in b["row"].tolist()]  # a list moves with its rows
        assert b["completion_mask"].sum(1).tolist() == [lengths[r] for r in b["row"].tolist()]
        assert int(b["num_items_in_batch"]) == 99  # per batch, kept
