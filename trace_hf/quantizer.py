# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The `HfQuantizer` behind `TraceFP4Config`: a thin layer over `trace_hf.experts` and `trace_hf.kv_cache`."""

from __future__ import annotations

from transformers.quantizers import HfQuantizer, register_quantizer
from transformers.utils import logging

from .config import QUANT_METHOD, TraceFP4Config


logger = logging.get_logger(__name__)


def convert_experts(model, config: TraceFP4Config) -> list[str]:
    """Swap the routed experts for FP4 ones and mark the hinted layers (works on a meta skeleton too)."""
    from .experts import assign_hint_layers, replace_experts

    replaced = replace_experts(model, config)
    if not replaced:
        logger.warning("TraceFP4Config: every experts module is in modules_to_not_convert; nothing is quantized.")
    assign_hint_layers(model, config.num_hint_layers(len(replaced)))
    return replaced


def install_kv_cache(model, config: TraceFP4Config) -> None:
    """FP4 KV for `generate` and the matching K/V fake quantization in training, if the config asks for it."""
    from .kv_cache import install_fp4_generate_cache, install_kv_fake_quant

    if config.kv_cache is not None:
        install_kv_fake_quant(model, config.kv_cache, config.qat)
        install_fp4_generate_cache(model, config.kv_cache)


def quantize_model(model, config: TraceFP4Config):
    """Apply `config` to a model that is already built (what `from_pretrained(..., quantization_config=...)` does
    while loading); returns the model."""
    convert_experts(model, config)
    install_kv_cache(model, config)
    model.config.quantization_config = config
    model.is_quantized = True
    model.quantization_method = config.quant_method
    model.hf_quantizer = TraceFP4HfQuantizer(config, pre_quantized=False)
    return model


@register_quantizer(QUANT_METHOD)
class TraceFP4HfQuantizer(HfQuantizer):
    """Swaps routed experts for `TraceFP4Experts` on the meta skeleton, keeps parameter names (so BF16
    checkpoints load without conversion ops), and saves BF16 masters plus the config (QAT-style)."""

    requires_calibration = False
    # Full-parameter QAT: transformers' Trainer checks both flags.
    is_qat_trainable = True

    def __init__(self, quantization_config: TraceFP4Config, **kwargs):
        super().__init__(quantization_config, **kwargs)

    @property
    def is_trainable(self) -> bool:
        return True

    def is_serializable(self) -> bool:
        return True

    def validate_environment(self, *args, **kwargs):
        return None

    def _process_model_before_weight_loading(self, model, **kwargs):
        convert_experts(model, self.quantization_config)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        install_kv_cache(model, self.quantization_config)
        return model

    def _dequantize(self, model, dtype=None):
        raise NotImplementedError(
            "TraceFP4 keeps BF16 master weights: load the checkpoint without quantization_config to get the plain model."
        )
