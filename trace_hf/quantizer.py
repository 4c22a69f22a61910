# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The `HfQuantizer` behind `TraceFP4Config`: a thin layer over `trace_hf.experts` and `trace_hf.kv_cache`."""

from __future__ import annotations

from transformers.quantizers import HfQuantizer, register_quantizer
from transformers.utils import logging

from .config import QUANT_METHOD, TraceFP4Config


logger = logging.get_logger(__name__)


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
        from .experts import assign_hint_layers, replace_experts

        cfg = self.quantization_config
        skip = self.get_modules_to_not_convert(model, cfg.modules_to_not_convert, add_default_skips=False)
        replaced = replace_experts(model, cfg.fmt, cfg.activations, skip)
        if not replaced:
            logger.warning("TraceFP4Config: every experts module is in modules_to_not_convert; nothing is quantized.")
        assign_hint_layers(model, cfg.num_hint_layers(len(replaced)))
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        from .kv_cache import install_fp4_generate_cache, install_kv_fake_quant

        cfg = self.quantization_config
        if cfg.kv_cache is not None:
            install_kv_fake_quant(model, cfg.kv_cache)
            install_fp4_generate_cache(model, cfg.kv_cache)
        return model

    def _dequantize(self, model, dtype=None):
        raise NotImplementedError(
            "TraceFP4 keeps BF16 master weights: load the checkpoint without quantization_config to get the plain model."
        )
