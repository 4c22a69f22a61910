# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The `HfQuantizer` behind `TraceFP4Config`: a thin layer over `trace_hf.quant.experts` and
`trace_hf.quant.kv_cache`."""

from __future__ import annotations

from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer, register_quantizer
from transformers.utils import logging

from ..models import is_skipped, softmax_topk_problems
from .config import QUANT_METHOD, TraceFP4Config
from .experts import is_fused_experts


logger = logging.get_logger(__name__)


#: What the refusals below name as supported.
SUPPORTED_FAMILIES = (
    "qwen3_moe, qwen3_5_moe / qwen3_5_moe_text, qwen2_moe, qwen3_next (softmax top-k routers, GQA attention)"
)


def check_supported(model, config: TraceFP4Config) -> None:
    """Refuse at load time what would otherwise run and compute something else than TRACE describes."""
    text = model.config.get_text_config(decoder=True)
    if config.kv_cache is not None and getattr(text, "kv_lora_rank", None):
        raise ValueError(
            f"{text.model_type} uses MLA attention (kv_lora_rank={text.kv_lora_rank}), whose K/V trace-hf's FP4 KV "
            f"cache does not model; pass TraceFP4Config(kv_cache=None) to keep the model's own cache (FP4 KV is "
            f"supported for {SUPPORTED_FAMILIES})."
        )
    problems = softmax_topk_problems(model, lambda m: is_fused_experts(m) or hasattr(m, "fmt"))
    if problems:
        raise ValueError(
            f"{text.model_type}'s router is not softmax top-k ({', '.join(problems)}): trace-hf's routing replay "
            f"rebuilds the top-k weights as a softmax over the router logits, which would silently change this "
            f"model's routing, so TraceFP4Config refuses it. "
            f"Supported are {SUPPORTED_FAMILIES}."
        )


def _check_modules_to_not_convert(model, config: TraceFP4Config) -> None:
    """A name that matches no module would leave the experts it meant quantized, silently."""

    if not config.modules_to_not_convert:
        return
    names = [n for n, _ in model.named_modules() if n]
    unknown = [m for m in config.modules_to_not_convert if not any(is_skipped(n, [m]) for n in names)]
    if unknown:
        experts = [n for n, m in model.named_modules() if is_fused_experts(m) or hasattr(m, "fmt")]
        shown = experts[:8] + (["..."] if len(experts) > 8 else [])
        raise ValueError(
            f"TraceFP4Config.modules_to_not_convert has names that match no module of {type(model).__name__}: "
            f"{unknown}. Use full module names or name suffixes; the experts modules are {shown}."
        )


def convert_experts(model, config: TraceFP4Config, packed_placeholders: bool = False) -> list[str]:
    """Swap the routed experts for FP4 ones and mark the hinted layers (works on a meta skeleton too). Frozen
    experts (`freeze_experts`) of a built model are quantized one layer at a time, each layer's BF16 experts
    dropped as its packed ones exist."""
    from .experts import assign_hint_layers, replace_experts

    check_supported(model, config)
    _check_modules_to_not_convert(model, config)
    replaced = replace_experts(model, config, packed_placeholders)
    if not replaced:
        logger.warning("TraceFP4Config: every experts module is in modules_to_not_convert; nothing is quantized.")
    assign_hint_layers(model, config.num_hint_layers(len(replaced)), config.hint_site_tuple)
    return replaced


def install_rollout_hooks(model, config: TraceFP4Config) -> None:
    """What runs around the model's own forward once its experts are FP4: the refresh of the packed experts at the
    start of every rollout (`freshness.install_prefill_refresh`) and, if the config asks for an FP4 KV cache, that
    cache for `generate` with the matching K/V fake quantization in training."""
    from .freshness import install_prefill_refresh
    from .kv_cache import install_fp4_generate_cache, install_kv_fake_quant

    install_prefill_refresh(model)
    if config.kv_cache is not None:
        install_kv_fake_quant(model, config.kv_cache, config.qat)
        install_fp4_generate_cache(model, config.kv_cache)


def quantize_model(model, config: TraceFP4Config):
    """Apply `config` to a model that is already built (what `from_pretrained(..., quantization_config=...)` does
    while loading); returns the model. Frozen experts of a model still on the meta device get placeholders in the
    packed layout, to be filled with `TraceFP4Experts.load_packed_weights` / `pack_from` layer by layer."""
    convert_experts(model, config, packed_placeholders=True)
    install_rollout_hooks(model, config)
    model.config.quantization_config = config
    model.is_quantized = True
    model.quantization_method = config.quant_method
    model.hf_quantizer = TraceFP4HfQuantizer(config, pre_quantized=False)
    return model


class TraceFP4Quantize(ConversionOps):
    """Load-time quantization of frozen experts (`freeze_experts`): transformers hands each experts tensor
    (`gate_up_proj` / `down_proj`, after the checkpoint's per-expert tensors are merged) to this op as it loads, and
    the op returns the packed codes under the tensor's own name plus the block and global scales beside it, so only
    one layer's BF16 experts exist at a time."""

    def __init__(self, hf_quantizer: TraceFP4HfQuantizer):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict, source_patterns=None, target_patterns=None, **kwargs):
        from .. import fp4
        from .expert_weights import frozen_buffers

        fmt = self.hf_quantizer.quantization_config.fmt
        out = {}
        for key, value in input_dict.items():
            tensor = value[0] if isinstance(value, list) else value
            out.update(frozen_buffers(key, fp4.quantize(tensor, fmt, scale="expert")))
        return out


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
        # A checkpoint saved with frozen experts holds their packed codes already; a BF16 one is quantized on load.
        convert_experts(model, self.quantization_config, packed_placeholders=self.pre_quantized)
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        """The experts tensors of frozen experts, loaded from a BF16 checkpoint."""
        from transformers.quantizers.quantizers_utils import get_module_from_name

        from .expert_weights import PROJS
        from .experts import TraceFP4Experts

        if not self.quantization_config.freeze_experts:
            return False
        module, name = get_module_from_name(model, param_name)
        return isinstance(module, TraceFP4Experts) and module.frozen and name in PROJS

    def get_quantize_ops(self):
        return TraceFP4Quantize(self)

    def _process_model_after_weight_loading(self, model, **kwargs):
        install_rollout_hooks(model, self.quantization_config)
        return model

    def _dequantize(self, model, dtype=None):
        raise NotImplementedError(
            "TraceFP4 keeps BF16 master weights, but a saved config.json still applies FP4 when loaded. To get the "
            "plain model, load the config, drop its quantization_config and pass it: config = "
            "AutoConfig.from_pretrained(path); del config.quantization_config; "
            "AutoModelForCausalLM.from_pretrained(path, config=config)."
        )
