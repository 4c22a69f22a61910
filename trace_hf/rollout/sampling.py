# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Sampling settings shared by every rollout path, and the engine's graph-safe sampler.

The settings are TRL's (`GRPOConfig.temperature`, `top_k`, `top_p`, `min_p`, `repetition_penalty`,
`max_completion_length`, the EOS ids), read off the `GenerationConfig` TRL builds. The engine's sampler applies them
in the order `transformers` does (repetition penalty, temperature, top-k, top-p, min-p) with the same rules, then
draws with the Gumbel-max trick from counter-based random numbers (`tl.rand`, Philox): the draw depends only on
(seed, step, row, token) (the row a sequence started in, wherever the engine's compaction moved it), so it needs no
generator state, replays inside a CUDA graph and is reproducible for a given seed. The log-prob it reports is the one TRL's training forward computes for the same token:
``log_softmax(raw_logits / temperature)``, not the truncated distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# GenerationConfig fields the engine implements; any other field that differs from its default is refused.
_HANDLED = {
    "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "eos_token_id",
    "pad_token_id", "bos_token_id", "cache_implementation", "disable_compile", "output_logits",
    "return_dict_in_generate", "max_length", "transformers_version", "_from_model_config", "use_cache",
    "compile_config", "_commit_hash", "generation_kwargs",
}  # fmt: skip


@dataclass(frozen=True)
class SamplingSettings:
    """What a rollout samples with; `transformers.GenerationConfig` names and meanings.

    ``do_sample=False`` (or ``temperature=0``) decodes greedily. ``seed`` makes the engine's draws reproducible;
    ``None`` draws a fresh seed from torch's default generator (so `transformers.set_seed` still governs it).
    """

    max_new_tokens: int
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int = 0
    do_sample: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: a rollout generates at least one token.")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}: sampling needs temperature > 0 (or do_sample=False).")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: use a value in (0, 1].")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p}: use a value in [0, 1].")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty}: use a value > 0 (1.0 is off).")

    @property
    def greedy(self) -> bool:
        return not self.do_sample

    @property
    def temperature_only(self) -> bool:
        """Sampling that truncates nothing: the draw and the log-prob read the same ``logits / temperature``."""
        truncating = (self.top_k, self.top_p, self.min_p, self.repetition_penalty)
        return self.do_sample and all(v is None for v in truncating)

    @property
    def logprob_temperature(self) -> float:
        """The temperature TRL divides the training logits by (1 when decoding greedily)."""
        return self.temperature if self.temperature > 0 else 1.0

    def key(self) -> tuple:
        """What a captured graph bakes in (everything but the seed)."""
        return (self.do_sample, self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty,
                self.eos_token_id, self.pad_token_id)  # fmt: skip

    @classmethod
    def from_generation_config(cls, gc, strict: bool = True, seed: int | None = None) -> SamplingSettings:
        """The settings of a `GenerationConfig` (as TRL builds it from `GRPOConfig` and `generation_kwargs`).

        With ``strict``, any other field set away from its default (beam search, `no_repeat_ngram_size`,
        `suppress_tokens`, ...) raises: the engine would silently sample something else."""
        from transformers import GenerationConfig

        if strict:
            default = GenerationConfig()
            odd = sorted(
                k for k, v in gc.to_dict().items()
                if k not in _HANDLED and not k.startswith("_") and v != getattr(default, k, None)
            )  # fmt: skip
            if odd:
                raise ValueError(
                    f"The rollout engine implements temperature, top_k, top_p, min_p, repetition_penalty, "
                    f"max_new_tokens and EOS stops, not {odd} (from generation_kwargs or the model's generation "
                    "config). Remove them, or roll out with TraceGRPOConfig(rollout_engine='generate')."
                )
        eos = gc.eos_token_id
        eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(int(e) for e in eos)
        pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else 0)
        if gc.max_new_tokens is None:
            raise ValueError("The rollout needs max_new_tokens (TRL: GRPOConfig.max_completion_length).")
        top_k = gc.top_k if gc.top_k not in (None, 0) else None
        return cls(
            max_new_tokens=int(gc.max_new_tokens),
            eos_token_id=eos,
            pad_token_id=int(pad),
            do_sample=bool(gc.do_sample) and (gc.temperature is None or gc.temperature > 0),
            temperature=1.0 if gc.temperature is None else float(gc.temperature),
            top_k=top_k,
            top_p=None if gc.top_p in (None, 1.0) else float(gc.top_p),
            min_p=None if gc.min_p in (None, 0.0) else float(gc.min_p),
            repetition_penalty=None if gc.repetition_penalty in (None, 1.0) else float(gc.repetition_penalty),
            seed=seed,
        )


def process_logits(logits: torch.Tensor, s: SamplingSettings, seen: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [B, V] logits -> the logits the draw uses, masked to -inf outside the kept set, as transformers'
    `RepetitionPenaltyLogitsProcessor`, `TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper` and
    `MinPLogitsWarper` compute them (``seen`` [B, V] bool: tokens of the prompt and completion so far).
    Static shapes and no host synchronization, so it can be captured in a CUDA graph."""
    x = logits
    if s.repetition_penalty is not None:
        if seen is None:
            raise ValueError("repetition_penalty needs the tokens seen so far.")
        p = s.repetition_penalty
        x = torch.where(seen, torch.where(x < 0, x * p, x / p), x)
    if s.greedy:
        return x
    if s.temperature != 1.0:
        x = x * (1.0 / s.temperature)  # what torch's CUDA division by a scalar computes, on every device
    ninf = float("-inf")
    if s.top_k is not None and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, ninf)
    if s.top_p is not None and s.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - s.top_p)
        drop[:, -1] = False
        x = x.masked_fill(drop.scatter(1, order, drop), ninf)
    if s.min_p is not None:
        probs = torch.softmax(x, dim=-1)
        drop = probs < s.min_p * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(drop, ninf)
    return x


def sampler_logprobs(logits: torch.Tensor, tokens: torch.Tensor, s: SamplingSettings) -> torch.Tensor:
    """log_softmax(raw logits / temperature) at the chosen tokens: what TRL's training forward computes."""
    x = logits.float() * (1.0 / s.logprob_temperature)
    return x.gather(-1, tokens.view(-1, 1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


def draw(x: torch.Tensor, s: SamplingSettings, seed: torch.Tensor, step: torch.Tensor,
         rows: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Token ids [B] (int64) from processed logits ``x`` [B, V]: argmax when greedy, else Gumbel-max with the
    counter-based noise of (``seed``, ``step``) (int64 device scalars, read at run time, so a graph replays with
    new draws) and each row's noise row ``rows`` (int64 [B]; default its own: a sequence the engine moved to another
    row draws what it would have drawn where it started)."""
    if s.greedy:
        return torch.argmax(x, dim=-1)
    from trace_hf.kernels.sampling import gumbel_argmax

    return gumbel_argmax(x, seed, step, rows=rows)


def sample(logits: torch.Tensor, s: SamplingSettings, seed: torch.Tensor, step: torch.Tensor,
           rows: torch.Tensor | None = None,
           seen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(token ids [B] int64, their log-probs [B] fp32) from raw logits [B, V] (any float dtype): `process_logits`,
    `draw` and `sampler_logprobs` (``rows`` and ``seen`` as there). Sampling with only a temperature runs them as one
    read of the logits (`gumbel_sample`: the same tokens as `draw`, the log-probs to fp32 rounding)."""
    if s.temperature_only:
        from trace_hf.kernels.sampling import gumbel_sample

        return gumbel_sample(logits, seed, step, 1.0 / s.temperature, rows=rows)
    raw = logits.float()
    tok = draw(process_logits(raw, s, seen), s, seed, step, rows)
    return tok, sampler_logprobs(raw, tok, s)
