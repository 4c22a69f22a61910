# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The `generate` rollout: `model.generate` inside a `HintRecorder`, for any transformers MoE (Qwen3.5 hybrids too).

The sampler's log-probs are read as generation goes: a forward hook on the CausalLM keeps the last position's
``log_softmax(logits / temperature)`` of the current step only, and a stopping criterion (called once the step's
token is chosen) keeps that token's log-prob. Memory stays at one ``[batch, vocab]`` row instead of the
``[batch, completion, vocab]`` logits that ``output_logits=True`` would stack.
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from ..hints import HintRecorder
from .base import RolloutOutput, causal_lm, cut_after_eos, eos_ids_of, left_pad, to_lists, vocab_size_of


class _LogprobTracker(StoppingCriteria):
    """Collects, per generated token, log_softmax(logits / T) at the chosen id; never stops generation."""

    def __init__(self, lm: torch.nn.Module, temperature: float):
        self.temperature = temperature
        self.current: torch.Tensor | None = None
        self.logps: list[torch.Tensor] = []
        self._hook = lm.register_forward_hook(self._on_forward)

    def _on_forward(self, module, args, output):
        logits = output.logits if hasattr(output, "logits") else output[0]
        self.current = torch.log_softmax(logits[:, -1].float() / self.temperature, dim=-1)

    def __call__(self, input_ids, scores, **kwargs):
        self.logps.append(self.current.gather(1, input_ids[:, -1:]).squeeze(1))
        self.current = None
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def remove(self):
        self._hook.remove()


def check_sampling(generation_config) -> None:
    """GRPO samples: beam search and other batch-reshaping strategies would return completions that were not
    sampled (their log-probs are not the sampler's) and would misalign the recorded hints."""
    beams = getattr(generation_config, "num_beams", 1) or 1
    groups = getattr(generation_config, "num_beam_groups", 1) or 1
    returns = getattr(generation_config, "num_return_sequences", 1) or 1
    if beams > 1 or groups > 1 or returns > 1:
        raise ValueError(
            f"Rollouts sample one completion per prompt row; generation_kwargs asked for num_beams={beams}, "
            f"num_beam_groups={groups}, num_return_sequences={returns}. Remove them (TRL repeats prompts "
            "num_generations times itself)."
        )


class GenerateRollout:
    """Rolls out through `model.generate` (eval mode: packed FP4 experts and FP4 KV cache for a TraceFP4Config
    model), recording hints and routing with a `HintRecorder` when asked."""

    name = "generate"

    def __call__(self, model, prompt_ids, generation_config, record: bool = False, storage: str = "device"):
        check_sampling(generation_config)
        lm = causal_lm(model)
        device = next(lm.parameters()).device
        pad = generation_config.pad_token_id
        ids, mask = left_pad(prompt_ids, 0 if pad is None else pad, device, vocab_size_of(lm))
        gc = copy.deepcopy(generation_config)
        gc.output_logits = False
        gc.return_dict_in_generate = False
        temperature = gc.temperature if gc.do_sample and gc.temperature else 1.0
        tracker = _LogprobTracker(lm, temperature)
        start = time.perf_counter()
        recorder = HintRecorder(lm, storage=storage) if record else contextlib.nullcontext()
        try:
            with torch.no_grad(), recorder:
                out = model.generate(
                    input_ids=ids, attention_mask=mask, generation_config=gc,
                    stopping_criteria=StoppingCriteriaList([tracker]),
                )  # fmt: skip
        finally:
            tracker.remove()
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        completion = sequences[:, ids.shape[1] :]
        logps = torch.stack(tracker.logps, dim=1) if tracker.logps else completion.new_zeros(completion.shape)
        if logps.shape[1] != completion.shape[1]:
            raise RuntimeError(
                f"generate returned {completion.shape[1]} completion columns but {logps.shape[1]} steps were sampled."
            )
        keep = cut_after_eos(completion, eos_ids_of(gc))
        hints = recorder.collect(torch.cat([mask, keep.to(mask.dtype)], dim=1)) if record else None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        completion_ids, logprobs = to_lists(completion, logps, keep)
        return RolloutOutput(completion_ids, logprobs, hints, self.name, time.perf_counter() - start)
