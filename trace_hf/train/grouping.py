# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""``train_sampling_strategy="group_by_length"`` for GRPO: each generation batch's rows go into the micro-batches of
gradient accumulation by length, not in TRL's random order.

Why: every training forward and backward costs a fixed setup at full depth (0.3-0.4 s and 0.65 s at 48 layers on
the H200, whatever the row's length; docs/lab-notes.md 6c), so long-tailed completions want several rows per
micro-batch; but a micro-batch runs as wide as its longest row, so in random order most of its columns are padding.
Sorted by length, the short rows share micro-batches and the long ones fill their own. transformers names this
sampling strategy ``"group_by_length"``; TRL's GRPO sampler ignores the field, so here it applies to the rows of a
generation batch, where the lengths are known.

The policy gradient of the optimizer step is the same in any order when every micro-batch weighs its rows alike,
which holds for the loss types whose normalizer does not depend on which rows share a micro-batch, and when every
optimizer step takes all the rows of a generation batch (``steps_per_generation = gradient_accumulation_steps``).
``num_iterations > 1`` keeps that, and is accepted: each of its repeated steps again takes the whole generation
batch. Otherwise the option is refused: with ``steps_per_generation`` above ``gradient_accumulation_steps`` one
generation batch is split over several optimizer steps, and sorted, each would see rows of one length only. The MoE
router's aux loss (``router_aux_loss_coef``) is TRL's per micro-batch, so it follows which tokens share one, in TRL's
random order too.
"""

from __future__ import annotations

import torch
from trl.trainer.utils import split_tensor_dict


#: TRL loss types whose micro-batch weights do not depend on which rows share a micro-batch: a mean over rows of
#: per-row terms (grpo, sapo, luspo) or a normalizer fixed for the whole batch (dr_grpo, dapo, cispo, vespo).
#: "bnpo" divides by the tokens of each micro-batch.
ORDER_FREE_LOSSES = ("grpo", "sapo", "luspo", "dr_grpo", "dapo", "cispo", "vespo")


def check_sampling_strategy(config) -> None:
    """Raise for a `train_sampling_strategy` the trainer cannot honour, naming what to change."""
    strategy = getattr(config, "train_sampling_strategy", "random")  # transformers < 5.2x: no such field
    if strategy == "random":
        return
    if strategy != "group_by_length":
        raise ValueError(
            f"TraceGRPOConfig(train_sampling_strategy={strategy!r}) is not supported: GRPO draws its prompts with "
            "TRL's repeat sampler. Use 'random' (TRL's shuffled micro-batches) or 'group_by_length' (micro-batches "
            "of rows of similar length, for long-tailed completions)."
        )
    why = []
    if config.loss_type not in ORDER_FREE_LOSSES:
        why.append(f"loss_type={config.loss_type!r} weighs each micro-batch by its own tokens")
    if config.steps_per_generation != config.gradient_accumulation_steps:
        why.append(
            f"steps_per_generation={config.steps_per_generation} makes several optimizer steps from one generation "
            f"batch (gradient_accumulation_steps={config.gradient_accumulation_steps}), each of which would see only "
            "rows of one length"
        )
    if config.top_entropy_quantile < 1.0:
        why.append(f"top_entropy_quantile={config.top_entropy_quantile} takes its threshold per micro-batch")
    if why:
        raise ValueError(
            "TraceGRPOConfig(train_sampling_strategy='group_by_length') would change the gradient: "
            + "; ".join(why)
            + f". Use one of loss_type {ORDER_FREE_LOSSES}, steps_per_generation = gradient_accumulation_steps and "
            "top_entropy_quantile=1.0, or train_sampling_strategy='random'."
        )


def group_by_length(batches: list[dict]) -> list[dict]:
    """The rows of TRL's micro-batches (`split_tensor_dict` pieces of one generation batch) regrouped into as many
    micro-batches of the same size, ordered by real length (prompt plus completion tokens), shortest first."""
    merged = {}
    for key, first in batches[0].items():
        if first is None or (isinstance(first, torch.Tensor) and first.ndim == 0):
            merged[key] = first  # per batch, not per row (num_items_in_batch)
        elif isinstance(first, torch.Tensor):
            merged[key] = torch.cat([b[key] for b in batches])
        else:
            merged[key] = [row for b in batches for row in b[key]]
    lengths = merged["prompt_mask"].sum(1) + merged["completion_mask"].sum(1)
    order = torch.argsort(lengths.cpu(), stable=True)

    def take(v):
        if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
            return v
        if isinstance(v, torch.Tensor):
            return v[order.to(v.device)]
        return [v[i] for i in order.tolist()]

    return split_tensor_dict({k: take(v) for k, v in merged.items()}, len(batches))
