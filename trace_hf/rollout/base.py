# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The rollout seam: what every rollout path takes and returns.

A rollout takes prompt token ids and a `transformers.GenerationConfig` (TRL builds one from `GRPOConfig`) and
returns a `RolloutOutput`: the completion ids cut after the first EOS, the sampler's log-probs of those tokens
(``log_softmax(logits / temperature)``, what TRL's training forward computes), and, when recording, a `HintBatch`
laid out per sample and position exactly as `HintRecorder.collect` lays it out. Nothing else travels from rollout
to training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate.utils import is_peft_model

from ..hints import HintBatch


@dataclass
class RolloutOutput:
    """One generation batch.

    Attributes:
        completion_ids: per row, the generated ids up to and including the first EOS (or all of them).
        logprobs: per row, the sampler's log-prob of each of those ids.
        hints: hints and routing of every fed token (prompt and completion), or None when not recording.
        engine: which path generated (`"engine"` or `"generate"`).
        seconds: wall time of the rollout (synchronized).
    """

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    hints: HintBatch | None
    engine: str
    seconds: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers CausalLM inside a PEFT wrapper (the module whose forward generate runs)."""
    return model.get_base_model() if is_peft_model(model) else model


def check_prompts(prompt_ids: list[list[int]]) -> None:
    """The check that there are prompts and that each has a token, naming the empty rows and the likely cause (a
    tokenizer that encodes nothing); `generate`'s path calls it through `left_pad`."""
    if not prompt_ids:
        raise ValueError("A rollout needs at least one prompt.")
    empty = [r for r, p in enumerate(prompt_ids) if len(p) == 0]
    if empty:
        raise ValueError(
            f"Prompts {empty[:8]} of {len(prompt_ids)} encode to no tokens; a rollout needs at least one per prompt. "
            "An empty prompt, or a tokenizer that encodes nothing (transformers loads such a one from a model "
            "folder without tokenizer files: save the tokenizer there, tokenizer.save_pretrained(path))."
        )


def left_pad(
    prompt_ids: list[list[int]], pad_id: int, device, vocab_size: int | None = None, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask [B, P], as TRL and generate lay prompts out (P: the longest prompt, or `width`).
    With `vocab_size`, the prompt ids are checked against it (`check_token_ids`) while they are still on the host."""
    check_prompts(prompt_ids)
    p = max(len(x) for x in prompt_ids) if width is None else width
    ids = torch.full((len(prompt_ids), p), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), p), dtype=torch.long)
    for r, x in enumerate(prompt_ids):
        ids[r, p - len(x) :] = torch.as_tensor(x, dtype=torch.long)
        mask[r, p - len(x) :] = 1
    if vocab_size is not None:
        check_token_ids(ids, mask, vocab_size)
    return ids.to(device), mask.to(device)


def vocab_size_of(lm: torch.nn.Module) -> int:
    """Rows of the input embedding table: the ids a forward can look up (the config's vocab_size otherwise)."""
    emb = lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else None
    return int(getattr(emb, "num_embeddings", None) or lm.config.vocab_size)


def check_token_ids(ids: torch.Tensor, mask: torch.Tensor, vocab_size: int) -> None:
    """Refuse prompt ids outside [0, vocab_size) before they reach the embedding, where they would be torch's bare
    IndexError on CPU and a device-side assert, which ends the process's CUDA context, on the GPU. One min/max over
    the host tensor per rollout; the row and id are looked up only on failure."""
    real = ids[mask.bool()]
    if real.numel() == 0 or (int(real.min()) >= 0 and int(real.max()) < vocab_size):
        return
    bad = (ids < 0) | (ids >= vocab_size)
    row, col = (bad & mask.bool()).nonzero()[0].tolist()
    pos = col - int((mask[row] == 0).sum())
    raise ValueError(
        f"Prompt row {row} holds token id {int(ids[row, col])} at position {pos}, outside the model's vocabulary "
        f"[0, {vocab_size}). Tokenize the prompts with the model's own tokenizer (and resize the embeddings, "
        "model.resize_token_embeddings, after adding tokens)."
    )


def cut_after_eos(completion: torch.Tensor, eos_ids) -> torch.Tensor:
    """[B, T] completion ids -> [B, T] mask that keeps tokens up to and including the first EOS (TRL's rule)."""
    eos = torch.tensor(list(eos_ids), dtype=completion.dtype, device=completion.device)
    is_eos = torch.isin(completion, eos)
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion.shape[1])
    return torch.arange(completion.shape[1], device=completion.device)[None] <= first[:, None]


def eos_ids_of(generation_config) -> tuple[int, ...]:
    eos = generation_config.eos_token_id
    return () if eos is None else (eos,) if isinstance(eos, int) else tuple(int(e) for e in eos)


def to_lists(completion: torch.Tensor, logps: torch.Tensor, mask: torch.Tensor):
    completion, logps, mask = completion.cpu(), logps.float().cpu(), mask.cpu()
    ids = [c[m].tolist() for c, m in zip(completion, mask, strict=True)]
    lps = [lp[m].tolist() for lp, m in zip(logps, mask, strict=True)]
    return ids, lps
