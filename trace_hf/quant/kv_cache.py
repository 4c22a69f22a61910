# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""FP4 KV cache for rollout, and the matching fake quantization of K and V for training.

K and V are quantized per token and head (one global scale per row of `head_dim`) by the same
`trace_hf.fp4` function on both sides: the cache stores packed codes and scales at write time, and the training
forward fake-quantizes K and V through an attention function wrapper. Hybrid models (Qwen3.5 MoE mixes
linear-attention and full-attention layers) keep their own cache layers; only full-attention layers are
swapped, which `transformers.QuantizedCache` cannot do.
"""

from __future__ import annotations

import weakref
from types import MethodType

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .. import fp4
from ..models import full_attention_layers, head_dim
from .sites import HintSite, attention_site


# K tensors an FP4KVLayer returned (id -> tensor, weakly): the attention wrapper skips quantizing those. A weak
# map, not a flag on the tensor: an entry goes when its tensor does, and a reused id cannot match another tensor.
_FROM_FP4_CACHE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class FP4KVLayer(DynamicLayer):
    """A growing cache layer that stores K and V as packed FP4 (codes, block scales, row scales).

    `keys` / `values` hold the packed codes [B, H, T, D/2] so that the base class's length bookkeeping works;
    each update returns the dequantized K and V in the model dtype.
    """

    def __init__(self, fmt: str = "nvfp4"):
        super().__init__()
        self.fmt = fmt
        self.site: HintSite | None = None  # the "kv" hint site of this decoder layer, bound by the HintRecorder

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        fp4.check_last_dim(key_states, self.fmt)
        self.dtype = key_states.dtype
        self.device = key_states.device
        self.keys = self.values = None
        self._k = self._v = None
        self.is_initialized = True

    @staticmethod
    def _append(old: fp4.FP4Tensor | None, new: fp4.FP4Tensor) -> fp4.FP4Tensor:
        if old is None:
            return new
        return fp4.FP4Tensor(
            torch.cat([old.packed, new.packed], dim=-2),
            torch.cat([old.block_scale, new.block_scale], dim=-2),
            torch.cat([old.global_scale, new.global_scale], dim=-2),
            old.fmt,
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        qk, qv = fp4.quantize(key_states, self.fmt, "row"), fp4.quantize(value_states, self.fmt, "row")
        if self.site is not None and self.site.recorder is not None:
            self.site.recorder.record_kv(self.site, qk, qv)
        self._k = self._append(self._k, qk)
        self._v = self._append(self._v, qv)
        self.keys, self.values = self._k.packed, self._v.packed
        k, v = self._k.dequantize(self.dtype), self._v.dequantize(self.dtype)
        _FROM_FP4_CACHE[id(k)] = k  # already FP4 values: the attention wrapper must not quantize them again
        return k, v

    @property
    def fp4_keys(self) -> fp4.FP4Tensor | None:
        """The cached K as stored (codes, block scales, row scales; [B, H, T, ...]); None before the first update."""
        return self._k

    @property
    def fp4_values(self) -> fp4.FP4Tensor | None:
        """The cached V as stored, as `fp4_keys`."""
        return self._v

    def _map(self, fn) -> None:
        if self._k is None:
            return
        self._k = fp4.FP4Tensor(
            *(fn(t) for t in (self._k.packed, self._k.block_scale, self._k.global_scale)), self.fmt
        )
        self._v = fp4.FP4Tensor(
            *(fn(t) for t in (self._v.packed, self._v.block_scale, self._v.global_scale)), self.fmt
        )
        self.keys, self.values = self._k.packed, self._v.packed

    def reset(self) -> None:
        self._k = self._v = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("FP4KVLayer.crop takes a negative number of tokens to remove.")
        if tokens_to_remove < 0 and self._k is not None:
            self._map(lambda t: t[..., :tokens_to_remove, :])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices, ...])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: reorder the packed codes and scales this layer actually reads (the base class would reorder
        only `keys`/`values`, which here are views for its length bookkeeping)."""
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def nbytes(self) -> int:
        return 0 if self._k is None else self._k.nbytes() + self._v.nbytes()


def fp4_cache(config, fmt: str = "nvfp4") -> DynamicCache:
    """A `DynamicCache` for `config` whose full-attention layers store FP4; other layer types are untouched."""
    cache = DynamicCache(config=config)
    for i in full_attention_layers(config):
        if type(cache.layers[i]) is DynamicLayer:
            cache.layers[i] = FP4KVLayer(fmt)
    return cache


def kv_bytes_per_token(config, fmt: str | None = "nvfp4", dtype_bytes: int = 2) -> int:
    """Bytes of K and V one token adds to the cache over all full-attention layers (FP4 if `fmt`, else BF16)."""
    text = config.get_text_config(decoder=True)
    hd = head_dim(config)
    rows = 2 * text.num_key_value_heads * len(full_attention_layers(config))
    if fmt is None:
        return rows * hd * dtype_bytes
    f = fp4.get_format(fmt)
    return rows * (hd // 2 + hd // f.block_size + (4 if f.has_global_scale else 0))


def install_fp4_generate_cache(model, fmt: str) -> None:
    """Make `model.generate` build an FP4 cache unless the caller passes a cache of their own.

    The one instance patch of a transformers internal in trace-hf: `generate` builds its default cache in
    `_prepare_cache_for_generation`, and no public hook (``cache_implementation`` names only transformers' own
    caches) lets a quantization method give it another one. Patched per model instance, calling the original."""
    original = type(model)._prepare_cache_for_generation

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        # transformers renamed the cache's key `past_key_values` -> `cache` (5.24): look under both.
        user_defined = {k for k in ("cache", "past_key_values") if model_kwargs.get(k) is not None}
        original(self, generation_config, model_kwargs, *args, **kwargs)
        for key in ("cache", "past_key_values"):
            if key not in user_defined and type(model_kwargs.get(key)) is DynamicCache:
                model_kwargs[key] = fp4_cache(self.config, fmt)

    model._prepare_cache_for_generation = MethodType(_prepare_cache_for_generation, model)


# ----------------------------------------------------------------------------------------------------------
# Training side: fake-quantize K and V inside the attention function
# ----------------------------------------------------------------------------------------------------------

#: The prefix of the K/V fake-quantizing wrappers' registered names, `trace_fp4_kv:<fmt>:<base>[:noqat]`.
KV_PREFIX = "trace_fp4_kv"


def _kv_attention(base: str, fmt: str, qat: bool):
    def attention(module, query, key, value, attention_mask, **kwargs):
        # Quantization is per token and head, so quantizing every K/V row here gives exactly the values an FP4
        # cache would hold; K/V that come out of an FP4KVLayer are FP4 already. Without QAT training keeps BF16.
        if _FROM_FP4_CACHE.get(id(key)) is not key and (qat or not module.training):
            site = attention_site(module)
            if site is not None and site.guide is not None and module.training:
                key, value = site.guide.kv(key, value)
            else:
                key = fp4.fake_quantize(key, fmt, "row")
                value = fp4.fake_quantize(value, fmt, "row")
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(base, None)
        if fn is None:  # "eager" lives in the modeling file, not in the registry
            import importlib

            fn = importlib.import_module(type(module).__module__).eager_attention_forward
        return fn(module, query, key, value, attention_mask, **kwargs)

    return attention


def kv_attention(base: str, fmt: str, qat: bool = True) -> str:
    """The registered name of the K/V fake-quantizing wrapper around attention `base` (registered on first use)."""
    name = f"{KV_PREFIX}:{fmt}:{base}" + ("" if qat else ":noqat")
    if name not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(name, _kv_attention(base, fmt, qat))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def install_kv_fake_quant(model, fmt: str, qat: bool = True) -> None:
    """Route attention through a wrapper that fake-quantizes K and V unless they come from an FP4 cache.

    The wrapper is registered as `trace_fp4_kv:<fmt>:<base>` in transformers' attention and mask registries and
    calls the model's own implementation (`sdpa`, `eager`, ...) after quantizing.
    """
    base = model.config._attn_implementation or "eager"
    if base.startswith(KV_PREFIX):
        return
    name = kv_attention(base, fmt, qat)
    model.config._attn_implementation = name  # `kv_format` reads the format back from this name
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and cfg is not model.config and getattr(cfg, "_attn_implementation", None) == base:
            cfg._attn_implementation = name


def kv_format(model) -> str | None:
    """The FP4 format of the model's KV cache (`TraceFP4Config.kv_cache`), None for a cache in the model dtype."""
    impl = getattr(model.config, "_attn_implementation", None) or ""
    return impl.split(":")[1] if impl.startswith(KV_PREFIX + ":") else None
