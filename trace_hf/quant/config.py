# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`TraceFP4Config`: the quantization config users pass to `from_pretrained`."""

from __future__ import annotations

from typing import Any

from transformers.quantizers import register_quantization_config
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..fp4 import FORMATS
from ..models import default_hint_layers


QUANT_METHOD = "trace_fp4"
#: Where hints can be recorded: the routed experts' input (the paper's site), each routed expert's down-projection
#: input (per token and chosen expert), and the FP4 K and V written to the cache (per token and KV head).
HINT_SITES = ("experts_input", "experts_hidden", "kv")
ACTIVATIONS = ("fp4", "none")
EXPERTS_KERNELS = ("auto", "triton", "torch")


def _hint_sites(sites) -> list[str]:
    """A list of site names; a bare string would otherwise be read as its characters."""
    if sites is None:
        return ["experts_input"]
    if isinstance(sites, str) or not isinstance(sites, (list, tuple)):
        raise ValueError(
            f"TraceFP4Config.hint_sites={sites!r}: give a list or tuple of sites, e.g. [{sites!r}] or "
            f"{list(HINT_SITES)}."
        )
    return list(sites)


@register_quantization_config(QUANT_METHOD)
class TraceFP4Config(QuantizationConfigMixin):
    """FP4 routed experts (and optionally an FP4 KV cache) that both train (QAT) and roll out.

    In `model.train()` the BF16 master weights stay the trainable parameters and the forward fake-quantizes them
    (straight-through gradients); in `model.eval()` / `generate` the experts run from packed FP4 weights cached
    from the masters. Both sides use the one format definition in `trace_hf.fp4`.

    Args:
        fmt (`str`, *optional*, defaults to `"nvfp4"`):
            FP4 format of expert weights, expert activations and hints: `"nvfp4"` (16-element blocks, E4M3 scales,
            fp32 global scale) or `"mxfp4"` (32-element blocks, E8M0 scales).
        activations (`str`, *optional*, defaults to `"fp4"`):
            `"fp4"` quantizes the experts' input and hidden activation per token (W4A4); `"none"` keeps them in
            the model dtype (W4A16). Hints need `"fp4"`.
        kv_cache (`str` or `None`, *optional*, defaults to `"nvfp4"`):
            Format of the KV cache of full-attention layers (`"nvfp4"`, `"mxfp4"`), or `None` for the model's own
            cache. Training fake-quantizes K and V with the same function.
        hint_layers (`int` or `None`, *optional*):
            How many of the last MoE layers record hints at rollout and apply them in training. Defaults to half
            of the MoE layers (rounded up); `0` disables hints.
        hint_sites (`list[str]`, *optional*, defaults to `["experts_input"]`):
            Where hints are recorded, at the `hint_layers` MoE layers: `"experts_input"` (the routed experts' input,
            as in the paper), `"experts_hidden"` (each routed expert's down-projection input, per token and chosen
            expert), `"kv"` (the FP4 K and V written to the cache by the attention of the same decoder layer, per
            token and KV head; needs `kv_cache` in the experts' `fmt`). Any subset, in any order.
        modules_to_not_convert (`list[str]`, *optional*):
            Names (or name suffixes) of modules to leave in the model dtype, e.g. `["model.layers.0.mlp.experts"]`.
        qat (`bool`, *optional*, defaults to `True`):
            Fake-quantize in training (QAT). `False` trains the BF16 masters with no fake quantization while the
            rollout stays FP4: the "naive FP4 rollout, BF16 training" baseline.
        experts_kernel (`str`, *optional*, defaults to `"auto"`):
            What computes the FP4 experts in `eval()` / `generate`: `"triton"` (the fused kernels of
            `trace_hf.kernels.fp4_moe`, which read the packed weights; NVFP4 only), `"torch"` (dequantized weights
            and grouped GEMMs, the same code as training, on any device), or `"auto"` (Triton on CUDA for NVFP4,
            torch otherwise). Training uses the torch path, except for frozen experts (`freeze_experts`), whose
            training forward runs the same kernel as `eval()` (the rollout's bits; backward: input gradients from
            the dequantized packed weights), but the torch path under `experts_hidden` hints.
        cache_qat_weights (`bool`, *optional*):
            Keep the fake-quantized expert weights between optimizer steps, so that training dequantizes them once
            per step: fastest, at the cost of one extra copy of the expert weights in the model dtype. `False`
            dequantizes them in every training forward instead (no extra memory; the same values). Under FSDP
            the cache holds each layer's gathered (unsharded) experts on every rank, so use `False` there.
            Defaults to `True`, and to `False` with `freeze_experts` (whose point is to hold no BF16 expert copy).
        freeze_experts (`bool`, *optional*, defaults to `False`):
            Freeze the routed experts as packed FP4: they hold only the FP4 codes, E4M3 block scales and fp32 global
            scales (buffers, no BF16 master parameters), quantized from a BF16 checkpoint as each experts tensor
            loads. Rollout and training both compute from those packed weights; training still fake-quantizes the
            experts' input and hidden activations (with hints), and backward gives input gradients only. For
            parameter-efficient RL (e.g. PEFT LoRA on the attention) of a full-size MoE on one GPU. Needs
            `qat=True`.
        prefill_bf16_gemms (`bool`, *optional*, defaults to `False`):
            Run the rollout prefill's routed experts, where each expert serves hundreds of tokens (on sm_90+ GPUs,
            `experts_kernel` Triton), as bf16 GEMMs: the packed weights decoded once per call (exactly) and one
            grouped GEMM at the BF16 tensor-core rate, about 1.3x faster than the FP4 kernels at a 16K-token
            prefill. Their sums are rounded to bf16 before the scales, where the FP4 kernels keep fp32, so some
            hidden FP4 codes round the other way: in the 8-layer GRPO benchmark this raised
            `trace/kl_rollout_train` by about 14%. Off by default for that reason. Decode and training forwards
            never use it.
        quantize_linears (`bool`, *optional*, defaults to `False`):
            Reserved opt-in for non-expert linears; only `False` is supported for now.
    """

    def __init__(
        self,
        fmt: str = "nvfp4",
        activations: str = "fp4",
        kv_cache: str | None = "nvfp4",
        hint_layers: int | None = None,
        hint_sites: list[str] | None = None,
        modules_to_not_convert: list[str] | None = None,
        qat: bool = True,
        experts_kernel: str = "auto",
        cache_qat_weights: bool | None = None,
        quantize_linears: bool = False,
        freeze_experts: bool = False,
        prefill_bf16_gemms: bool = False,
        **kwargs,
    ):
        self.quant_method = QUANT_METHOD
        self.fmt = fmt
        self.activations = activations
        self.kv_cache = kv_cache
        self.hint_layers = hint_layers
        self.hint_sites = _hint_sites(hint_sites)
        self.modules_to_not_convert = list(modules_to_not_convert) if modules_to_not_convert else []
        self.qat = qat
        self.experts_kernel = experts_kernel
        self.cache_qat_weights = cache_qat_weights
        self.quantize_linears = quantize_linears
        self.freeze_experts = freeze_experts
        self.prefill_bf16_gemms = prefill_bf16_gemms
        kwargs.pop("quant_method", None)
        if kwargs:
            raise ValueError(f"Unknown TraceFP4Config arguments {sorted(kwargs)}.")
        self.post_init()

    def post_init(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"TraceFP4Config.fmt={self.fmt!r} is not supported: use one of {sorted(FORMATS)}.")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"TraceFP4Config.activations={self.activations!r}: use 'fp4' (W4A4) or 'none' (W4A16).")
        if self.kv_cache is not None and self.kv_cache not in FORMATS:
            raise ValueError(
                f"TraceFP4Config.kv_cache={self.kv_cache!r}: use one of {sorted(FORMATS)}, or None for a BF16 cache."
            )
        # bool is an int subclass: True would silently mean one layer.
        hl = self.hint_layers
        if hl is not None and (isinstance(hl, bool) or not isinstance(hl, int) or hl < 0):
            raise ValueError(
                f"TraceFP4Config.hint_layers={self.hint_layers!r}: give an int number of last MoE layers >= 0 (not "
                "a bool), or None for half of them."
            )
        bad = [s for s in self.hint_sites if s not in HINT_SITES]
        if bad:
            raise ValueError(
                f"TraceFP4Config.hint_sites has unsupported sites {bad}: supported are {list(HINT_SITES)}."
            )
        if len(set(self.hint_sites)) != len(self.hint_sites) or not self.hint_sites:
            raise ValueError(
                f"TraceFP4Config.hint_sites={self.hint_sites!r}: name each site once, at least one of "
                f"{list(HINT_SITES)} (hint_layers=0 disables hints)."
            )
        if "kv" in self.hint_sites and self.kv_cache != self.fmt:
            raise ValueError(
                f"hint_sites has 'kv' but kv_cache={self.kv_cache!r} with fmt={self.fmt!r}: K/V hints guide the FP4 KV "
                f"cache's rounding in the experts' format, so set kv_cache={self.fmt!r}, or drop 'kv' from hint_sites."
            )
        if self.hint_layers and self.activations != "fp4":
            raise ValueError(
                "Hints record how FP4 activations were rounded, so they need activations='fp4'; set hint_layers=0 "
                "for W4A16."
            )
        if not isinstance(self.qat, bool):
            raise ValueError(f"TraceFP4Config.qat={self.qat!r}: give True (QAT) or False (BF16 training).")
        if self.cache_qat_weights is not None and not isinstance(self.cache_qat_weights, bool):
            raise ValueError(
                f"TraceFP4Config.cache_qat_weights={self.cache_qat_weights!r}: give True, False or None (the default)."
            )
        if not isinstance(self.prefill_bf16_gemms, bool):
            raise ValueError(f"TraceFP4Config.prefill_bf16_gemms={self.prefill_bf16_gemms!r}: give True or False.")
        if not isinstance(self.freeze_experts, bool):
            raise ValueError(f"TraceFP4Config.freeze_experts={self.freeze_experts!r}: give True or False.")
        if self.freeze_experts and not self.qat:
            raise ValueError(
                "TraceFP4Config(freeze_experts=True, qat=False) contradicts itself: qat=False trains the experts' BF16 "
                "masters, and frozen experts have none (only packed FP4). Keep qat=True (the default) with frozen "
                "experts, or set freeze_experts=False for the BF16-training baseline."
            )
        if self.experts_kernel not in EXPERTS_KERNELS:
            raise ValueError(
                f"TraceFP4Config.experts_kernel={self.experts_kernel!r}: use one of {list(EXPERTS_KERNELS)}."
            )
        if self.experts_kernel == "triton" and self.fmt != "nvfp4":
            raise ValueError(
                f"experts_kernel='triton' runs NVFP4 only, got fmt={self.fmt!r}; use experts_kernel='torch' or 'auto'."
            )
        if self.quantize_linears:
            raise ValueError("quantize_linears=True is not supported yet: only routed experts are quantized.")

    @property
    def resolved_cache_qat_weights(self) -> bool:
        """`cache_qat_weights` with its default filled in: on, except for frozen experts."""
        return (not self.freeze_experts) if self.cache_qat_weights is None else self.cache_qat_weights

    @property
    def hint_site_tuple(self) -> tuple[str, ...]:
        """The sites in the canonical order of `HINT_SITES` (the order records and metrics use)."""
        return tuple(s for s in HINT_SITES if s in self.hint_sites)

    def num_hint_layers(self, num_moe_layers: int) -> int:
        if self.activations != "fp4":
            return 0
        n = default_hint_layers(num_moe_layers) if self.hint_layers is None else self.hint_layers
        if n > num_moe_layers:
            raise ValueError(
                f"hint_layers={n} but the model has only {num_moe_layers} MoE layers; use at most {num_moe_layers}."
            )
        return n

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": self.quant_method,
            "fmt": self.fmt,
            "activations": self.activations,
            "kv_cache": self.kv_cache,
            "hint_layers": self.hint_layers,
            "hint_sites": list(self.hint_sites),
            "modules_to_not_convert": list(self.modules_to_not_convert),
            "qat": self.qat,
            "experts_kernel": self.experts_kernel,
            "cache_qat_weights": self.cache_qat_weights,
            "quantize_linears": self.quantize_linears,
            "freeze_experts": self.freeze_experts,
            "prefill_bf16_gemms": self.prefill_bf16_gemms,
        }
