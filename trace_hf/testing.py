# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Offline fixtures: tiny MoE models and a character tokenizer.

No machine this project runs on (CI, the developers', the GPU box) can reach the Hugging Face Hub, so every
test and the default run of ``examples/grpo.py`` use what this module builds locally. The fixtures go through
the real code paths anyway: models come from ``AutoModelForCausalLM.from_config`` and can be written with
``save_pretrained`` so that ``from_pretrained(path)`` is exercised, the tokenizer is a real
``PreTrainedTokenizerFast``. The data sets and the reward live in `trace_hf.data`; their names are re-exported
here so that older imports (``from trace_hf.testing import arithmetic_reward``) keep working.

Model sizes are multiples of 32 wherever a quantizer may look (hidden size, expert width, head dim), so both
NVFP4 (blocks of 16) and MXFP4 (blocks of 32) fit without padding.
"""

from __future__ import annotations

import os
import string
from typing import Any

import torch

from .data import (  # noqa: F401  (re-exported: they lived here before trace_hf.data)
    OFFLINE_DATASET,
    addition_dataset,
    arithmetic_dataset,
    arithmetic_reward,
    extract_final_number,
    format_prompt,
    load_math_dataset,
    to_grpo_dataset,
)


__all__ = [
    "FAMILIES",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "ALPHABET",
    "build_char_tokenizer",
    "save_char_tokenizer",
    "tiny_qwen3_moe_config",
    "tiny_qwen3_5_moe_config",
    "tiny_config",
    "tiny_model",
    "save_tiny_model",
]

# ----------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<|im_start|>", "<|im_end|>"
#: Special tokens, in id order (ids 0..3). ``<|im_start|>``/``<|im_end|>`` double as BOS/EOS, as in Qwen's chat
#: format, so a completion ends where a chat turn would.
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS)
#: The characters the fixtures' text is written in; each is one token (the id of ASCII character ``c`` is
#: ``len(SPECIAL_TOKENS) + ord(c)``). Any other text still round-trips, one token per UTF-8 byte.
ALPHABET = string.digits + string.ascii_letters + " " + string.punctuation + "\n"
#: A minimal Qwen-style chat template, enough for TRL's conversational path and ``apply_chat_template``.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen's pre-tokenizer split. With no merges it cannot change ids, but keeping the exact pipeline of
# transformers' Qwen3_5Tokenizer means both loaders build the same tokenizer (see build_char_tokenizer).
_QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable-unicode map (what ``pre_tokenizers.ByteLevel`` emits), as a list by byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    sym, extra = {}, 0
    for b in range(256):
        if b in keep:
            sym[b] = chr(b)
        else:
            sym[b] = chr(256 + extra)
            extra += 1
    return [sym[b] for b in range(256)]


def build_char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast``: one token per byte, so one per character of `ALPHABET`.

    Small (260 ids), deterministic and needs no download. It is a byte-level BPE with no merges, built with
    exactly the pipeline of transformers' ``Qwen3_5Tokenizer``: ``AutoTokenizer`` insists on that class for a
    ``qwen3_5_moe_text`` checkpoint and rebuilds the tokenizer from the saved vocabulary, and with this pipeline
    the rebuilt one gives the same ids. Every byte has a token, so nothing maps to ``<unk>`` (which is kept
    only as the declared unknown token). Left padding, because decoder-only generation pads on the left, which
    is also the layout hint alignment has to survive.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for sym in _byte_symbols():
        vocab[sym] = len(vocab)
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[],
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_char_tokenizer(path: str | os.PathLike) -> str:
    """Write the character tokenizer to `path` (``AutoTokenizer.from_pretrained(path)`` loads it back)."""
    path = os.fspath(path)
    build_char_tokenizer().save_pretrained(path)
    return path


# ----------------------------------------------------------------------------------------------------------
# Tiny models
# ----------------------------------------------------------------------------------------------------------

#: Model families the fixtures build, by ``model_type``.
FAMILIES = ("qwen3_moe", "qwen3_5_moe_text")

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}


def _token_ids(vocab_size: int | None, tokenizer=None) -> dict[str, Any]:
    tok = tokenizer if tokenizer is not None else build_char_tokenizer()
    return {
        "vocab_size": vocab_size if vocab_size is not None else len(tok),
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }


def tiny_qwen3_moe_config(vocab_size: int | None = None, tokenizer=None, **overrides):
    """A 4-layer ``Qwen3MoeConfig`` where every layer is MoE (8 experts, top-2).

    ``vocab_size`` defaults to the character tokenizer's; special-token ids come from `tokenizer` (default: the
    character tokenizer). ``overrides`` win over everything.
    """
    from transformers import Qwen3MoeConfig

    kwargs = {
        **_COMMON,
        "intermediate_size": 64,  # dense MLP width; unused while every layer is MoE
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        **_token_ids(vocab_size, tokenizer),
        **overrides,
    }
    return Qwen3MoeConfig(**kwargs)


def tiny_qwen3_5_moe_config(vocab_size: int | None = None, tokenizer=None, **overrides):
    """A 4-layer ``Qwen3_5MoeTextConfig`` (``model_type="qwen3_5_moe_text"``): the hybrid architecture.

    Layers alternate linear attention (Gated DeltaNet) and full attention (``full_attention_interval=2``:
    layers 0 and 2 linear, 1 and 3 full), which is the case the FP4 KV cache must handle (only full-attention
    layers have a K/V cache). Every layer is MoE with 8 routed experts (top-2) plus a shared expert.
    """
    from transformers import Qwen3_5MoeTextConfig

    kwargs = {
        **_COMMON,
        "shared_expert_intermediate_size": 32,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        **_token_ids(vocab_size, tokenizer),
    }
    interval = overrides.pop("full_attention_interval", 2)
    if "layer_types" not in overrides:
        n_layers = overrides.get("num_hidden_layers", kwargs["num_hidden_layers"])
        kwargs["layer_types"] = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
        ]
    kwargs.update(overrides)
    return Qwen3_5MoeTextConfig(**kwargs)


def tiny_config(family: str = "qwen3_moe", vocab_size: int | None = None, tokenizer=None, **overrides):
    """The tiny config of `family` (one of `FAMILIES`)."""
    if family == "qwen3_moe":
        return tiny_qwen3_moe_config(vocab_size, tokenizer, **overrides)
    if family in ("qwen3_5_moe_text", "qwen3_5_moe"):
        return tiny_qwen3_5_moe_config(vocab_size, tokenizer, **overrides)
    raise ValueError(f"Unknown tiny model family {family!r}: use one of {FAMILIES}.")


def tiny_model(
    family: str = "qwen3_moe",
    tokenizer=None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides,
):
    """A randomly initialised tiny MoE causal LM, built through ``AutoModelForCausalLM.from_config``.

    The vocabulary matches `tokenizer` (default: the character tokenizer) and pad/bos/eos ids are set on both
    the config and the generation config, so ``generate`` stops and pads like a real checkpoint. The weights
    depend only on `seed` (the global RNG is left as it was).
    """
    from transformers import AutoModelForCausalLM

    tokenizer = tokenizer if tokenizer is not None else build_char_tokenizer()
    config = tiny_config(family, tokenizer=tokenizer, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = model.generation_config
    gen.pad_token_id = tokenizer.pad_token_id
    gen.bos_token_id = tokenizer.bos_token_id
    gen.eos_token_id = tokenizer.eos_token_id
    return model


def save_tiny_model(
    path: str | os.PathLike,
    family: str = "qwen3_moe",
    tokenizer=None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> str:
    """Write a tiny model and its tokenizer to `path`, so that code under test can ``from_pretrained(path)``.

    Returns the path as a string (what ``from_pretrained`` and TRL's ``model=`` argument take).
    """
    path = os.fspath(path)
    tokenizer = tokenizer if tokenizer is not None else build_char_tokenizer()
    model = tiny_model(family, tokenizer=tokenizer, seed=seed, dtype=dtype, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
