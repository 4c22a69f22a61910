# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Export a trained policy as a compressed-tensors NVFP4 checkpoint (what vLLM, SGLang and transformers load), and
load one back to start RL from it.

The routed experts are written per expert and projection under the model's original checkpoint names
(transformers' own conversion mapping, reverted: ``...mlp.experts.3.gate_proj``), in compressed-tensors'
``nvfp4-pack-quantized`` layout: ``weight_packed`` (two E2M1 codes a byte, the low nibble first, as in trace-hf),
``weight_scale`` (the E4M3 block-scale bytes), ``weight_global_scale`` and, for W4A4, ``input_global_scale``. The
codes and scale bytes are the trained policy's own. compressed-tensors stores the global scale the other way up:
it divides by ``G = 448 * 6 / amax`` where trace-hf multiplies by ``g = amax / (448 * 6)``, so ``G`` is written as
the fp32 reciprocal of ``g``. Gate and up share one global scale per expert (trace-hf quantizes the fused
gate_up with one), which is also what vLLM's fused gate/up kernels want. Everything else is written in BF16 and
listed in the config's ``ignore``.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.utils import logging

from .. import fp4
from ..quant.experts import TraceFP4Experts
from .destination import checkpoint_files, remove_files


logger = logging.get_logger(__name__)

FORMAT = "compressed-tensors"  # transformers' `quant_method` for these checkpoints
CT_FORMAT = "nvfp4-pack-quantized"  # compressed-tensors' CompressionFormat of NVFP4
SCHEMES = ("NVFP4", "NVFP4A16")  # compressed-tensors' preset names: W4A4 (calibrated inputs), weight-only
WEIGHTS_FILE = "model.safetensors"
_PROJS = ("gate_up_proj", "down_proj")


def require_compressed_tensors():
    """Raise an ImportError naming the install when compressed-tensors is missing (scripts check it up front)."""
    try:
        import compressed_tensors  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "format='compressed-tensors' needs the compressed-tensors package: pip install 'trace-hf[serve]' "
            "(or pip install compressed-tensors)."
        ) from e


def _fp4_experts(model, what: str) -> dict[str, TraceFP4Experts]:
    experts = {n: m for n, m in model.named_modules() if isinstance(m, TraceFP4Experts)}
    if not experts:
        raise ValueError(
            f"{what} needs a model whose routed experts are FP4: load it with "
            "from_pretrained(..., quantization_config=TraceFP4Config()) first."
        )
    bad = sorted({m.fmt for m in experts.values()} - {"nvfp4"})
    if bad:
        raise ValueError(
            f"{what}: compressed-tensors' NVFP4 format holds NVFP4 experts, but these are {bad}; train with "
            "TraceFP4Config(fmt='nvfp4') to serve them this way, or export with format='trace_fp4'."
        )
    return experts


# ----------------------------------------------------------------------------------------------------------
# Names: the model's original checkpoint layout
# ----------------------------------------------------------------------------------------------------------


def _with_expert_converters(model) -> None:
    """Make `model._weight_conversions` (what `from_pretrained` keeps of the conversions it used, and what saving
    reverts) include the family's expert converters: a model loaded from a checkpoint whose experts did not go
    through them (the NVFP4 ones, installed by `load_compressed_tensors`) would otherwise save them fused."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    own = getattr(model, "_weight_conversions", None)
    if own is None:
        return  # built from a config: transformers reverts with the family's default mapping
    have = {tuple(c._original_source_patterns) for c in own if isinstance(c, WeightConverter)}
    extra = [
        c
        for c in get_model_conversion_mapping(model, add_legacy=False)
        if isinstance(c, WeightConverter) and tuple(c._original_source_patterns) not in have
    ]
    model._weight_conversions = list(own) + extra


def _revert(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    _with_expert_converters(model)
    return revert_weight_conversion(model, dict(state))


def _per_expert(model, name: str, proj: str, shape) -> list[list[str]]:
    """The original checkpoint's weight names of `name.proj`'s experts, ``[expert][part]`` (parts: gate, up for the
    fused gate_up; one for down), read off transformers' reverted conversion of a tensor of row numbers."""
    e, rows = shape[0], shape[1]
    parts = 2 if proj == "gate_up_proj" else 1
    index = torch.arange(e * rows).reshape(e, rows, 1)
    out = _revert(model, {f"{name}.{proj}": index})
    if len(out) != e * parts or not all(k.endswith(".weight") for k in out):
        raise ValueError(
            f"{type(model).__name__} ({model.config.model_type}) stores its experts fused in its original "
            f"checkpoints (transformers maps {name}.{proj} to {sorted(out)[:2]}), so compressed-tensors has no "
            "per-expert Linear to hold them; this export supports families whose checkpoints keep one Linear per "
            "expert (Qwen3-MoE, Qwen3.5-MoE, OLMoE, ...). Export this model with format='trace_fp4'."
        )
    grid = [[None] * parts for _ in range(e)]
    for k, t in out.items():
        first = int(t.reshape(-1)[0])
        grid[first // rows][(first % rows) // (rows // parts)] = k
    return grid


def _split(model, name: str, proj: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """`t` [E, rows, ...] (fused layout) split as transformers splits the weights: {original weight name: part}."""
    return {k: v.contiguous() for k, v in _revert(model, {f"{name}.{proj}": t}).items()}


# ----------------------------------------------------------------------------------------------------------
# Activation calibration
# ----------------------------------------------------------------------------------------------------------


def _calibration_batches(calibration) -> Iterable[dict]:
    from ..hints import HintBatch

    items = [calibration] if isinstance(calibration, (torch.Tensor, dict, HintBatch)) else calibration
    for item in items:
        if isinstance(item, HintBatch):
            if item.token_ids is None:
                raise ValueError(
                    "The HintBatch passed as calibration has no token_ids (its rollout fed embeddings); pass the "
                    "rollout's input_ids instead."
                )
            lengths = item.lengths.to(item.token_ids.device)
            mask = torch.arange(item.token_ids.shape[1], device=lengths.device)[None] < lengths[:, None]
            yield {"input_ids": item.token_ids.long() * mask, "attention_mask": mask.long()}
        elif isinstance(item, torch.Tensor):
            yield {"input_ids": item if item.ndim == 2 else item[None]}
        elif isinstance(item, dict) and "input_ids" in item:
            yield {k: item[k] for k in ("input_ids", "attention_mask") if k in item}
        else:
            raise TypeError(
                f"calibration items must be token-id tensors [batch, seq], dicts with input_ids (and attention_mask) "
                f"or HintBatch records of rollouts; got {type(item).__name__}."
            )


def _check_calibration_ids(ids, vocab_size: int, index: int) -> None:
    """Token ids the embedding can look up, checked before the forward: there a float tensor or an id outside the
    vocabulary is torch's bare embedding error (a device-side assert on the GPU), which never names `calibration`."""
    where = f"calibration batch {index}"
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{where}: input_ids is a {type(ids).__name__}; give a tensor of token ids [batch, seq].")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(
            f"{where} holds input_ids of dtype {ids.dtype}; give integer token ids (the tokenizer's input_ids, "
            "torch.long), not embeddings, probabilities or masks."
        )
    if ids.ndim != 2:
        raise ValueError(f"{where} holds input_ids of shape {tuple(ids.shape)}; give token ids [batch, seq].")
    if ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < vocab_size):
        return
    row, col = ((ids < 0) | (ids >= vocab_size)).nonzero()[0].tolist()
    raise ValueError(
        f"{where} holds token id {int(ids[row, col])} at row {row}, position {col}, outside the model's vocabulary "
        f"[0, {vocab_size}) (padding too: the forward embeds every position). Calibrate on ids of the model's own "
        "tokenizer, e.g. the training prompts, or the HintBatch of recorded rollouts."
    )


@torch.no_grad()
def calibrate_input_amax(model, calibration) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per experts module: (amax of its input over all real tokens [1], amax of each expert's hidden [E]).

    The model runs `calibration` in eval mode. The input amax is what the experts' gate/up Linears see (one
    tensor per layer: every expert reads the same hidden states); the hidden amax is each expert's down-projection
    input over the tokens routed to it, computed as the rollout computes it (FP4 input per token, FP4 weights). An
    expert no calibration token reached gets the layer's largest hidden amax.
    """
    from ..rollout.base import vocab_size_of

    experts = _fp4_experts(model, "calibration")
    found = {n: [torch.zeros(()), torch.zeros(m.num_experts)] for n, m in experts.items()}
    state = {"mask": None}
    weights = {}  # dequantized gate_up per module, computed once (the packed weights do not change here)

    def hook(name, m, args, kwargs):
        names = ("hidden_states", "top_k_index", "top_k_weights")
        x, top_k = (args[i] if len(args) > i else kwargs[names[i]] for i in range(2))
        x, top_k = x.reshape(-1, x.shape[-1]).float(), top_k.reshape(-1, top_k.shape[-1])
        mask = state["mask"]
        if mask is not None and mask.numel() == x.shape[0]:
            x, top_k = x[mask], top_k[mask]
        if x.numel() == 0:
            return
        amax_in, amax_h = found[name]
        found[name][0] = torch.maximum(amax_in, x.abs().amax().cpu())
        xq = x if m.activations == "none" else fp4.quantize(x, m.fmt, "row").dequantize()
        if name not in weights:
            weights[name] = m.packed_weights()[0].dequantize()
        gu = weights[name]
        for e in top_k.unique().tolist():
            if not 0 <= e < m.num_experts:
                continue
            rows = (top_k == e).any(-1)
            gate, up = (xq[rows] @ gu[e].T).chunk(2, dim=-1)
            h = m.act_fn(gate) * up
            amax_h[e] = torch.maximum(amax_h[e], h.abs().amax().cpu())

    handles = [
        m.register_forward_pre_hook(lambda m, a, k, n=n: hook(n, m, a, k), with_kwargs=True)
        for n, m in experts.items()
    ]
    was_training = model.training
    model.eval()
    seen = 0
    vocab_size = vocab_size_of(model)
    try:
        device = next(model.parameters()).device
        for batch in _calibration_batches(calibration):
            _check_calibration_ids(batch["input_ids"], vocab_size, seen)
            batch = {k: v.to(device) for k, v in batch.items()}
            mask = batch.get("attention_mask")
            state["mask"] = None if mask is None else mask.reshape(-1).bool()
            model(**batch, use_cache=False)
            seen += 1
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if not seen:
        raise ValueError("calibration is empty: pass at least one batch of token ids (or rollout records).")
    out = {}
    for name, (amax_in, amax_h) in found.items():
        if float(amax_in) == 0:
            raise ValueError(
                f"No calibration token reached {name}: pass calibration batches with real (unmasked) tokens."
            )
        out[name] = (amax_in.reshape(1), torch.where(amax_h > 0, amax_h, amax_h.max()))
    return out


def _input_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' own static per-tensor activation scale of an observed amax (448 * 6 / amax)."""
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    return generate_gparam(-amax.float(), amax.float()).reshape(1)


# ----------------------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------------------


def weight_global_scale(g: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' weight_global_scale of trace-hf's global scales `g`: the fp32 reciprocal. An all-zero
    expert (g = 0, all scale bytes 0) gets 1, compressed-tensors' own value for an empty tensor."""
    g = g.float()
    if not torch.isfinite(g).all():
        raise ValueError("The experts' FP4 global scales are not finite (NaN/inf masters); fix the weights first.")
    return torch.where(g > 0, torch.ones_like(g) / g, torch.ones_like(g))


def trace_global_scale(G: torch.Tensor) -> torch.Tensor:
    """trace-hf's `g` of a compressed-tensors weight_global_scale `G`: an fp32 `g` whose fp32 reciprocal is `G`
    (so that exporting again writes the same `G`), found among the neighbours of 1/G; 1/G where none is."""
    G = G.float()
    g0 = torch.ones_like(G) / G
    best = g0.clone()
    found = (torch.ones_like(g0) / g0) == G
    for step in (1, -1, 2, -2):
        c = g0
        for _ in range(abs(step)):
            c = torch.nextafter(c, torch.full_like(c, float("inf") if step > 0 else 0.0))
        hit = ~found & ((torch.ones_like(c) / c) == G)
        best = torch.where(hit, c, best)
        found |= hit
    return best


def _ignore_names(model, skip: set[str]) -> list[str]:
    """The original checkpoint names of every other module with a 2-D weight (attention, router, shared experts,
    lm_head): compressed-tensors' `ignore`, so that a loader matching the `Linear` target leaves them dense."""
    weights = {
        f"{n}.weight": m.weight
        for n, m in model.named_modules()
        if n not in skip
        and not isinstance(m, torch.nn.Embedding)
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.ndim == 2
    }
    reverted = _revert(model, weights)
    return sorted(k.removesuffix(".weight") for k in reverted)


def _bf16_state(model, skip: set[str]) -> dict[str, torch.Tensor]:
    """The state dict without the experts, floating tensors in BF16, under the original checkpoint names (tied
    embeddings once: `from_pretrained` ties them again from the config)."""
    out, seen = {}, set()
    for k, v in model.state_dict().items():
        if k.rsplit(".", 1)[0] in skip:
            continue
        key = (v.device, v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), tuple(v.stride()))
        if v.numel() and key in seen:
            continue
        seen.add(key)
        v = v.detach().cpu()
        out[k] = (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
    return _revert(model, out)


def _quantization_config(scheme: str, ignore: list[str]):
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

    return QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])},
        format=CT_FORMAT,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=ignore,
    )


def export_compressed_tensors(
    model,
    directory: str | os.PathLike,
    scheme: str = "NVFP4",
    calibration=None,
    tokenizer=None,
    overwrite: bool = False,
) -> dict[str, int]:
    """Write `model` (FP4 experts, `TraceFP4Config(fmt="nvfp4")`) as a compressed-tensors NVFP4 checkpoint.

    Args:
        scheme: compressed-tensors' preset: `"NVFP4"` (W4A4: FP4 weights and activations, with per-tensor input
            global scales calibrated on `calibration`) or `"NVFP4A16"` (weight-only; no calibration).
        calibration: what the input scales are calibrated on: token-id tensors [batch, seq], dicts with
            `input_ids` (and `attention_mask`), or `HintBatch` records of rollouts (their tokens), one or an
            iterable of them. Each Linear's `input_global_scale` is 448 * 6 over the largest amax it saw.
        tokenizer: saved beside the weights when given. The model's generation config is saved when it has one.
        overwrite: delete the checkpoint files `directory` already holds just before writing; without it such a
            directory is refused, before calibration (`trace_hf.export.destination`).

    Returns the bytes written for the experts and for the other weights.
    """
    require_compressed_tensors()
    from compressed_tensors.compressors import ModelCompressor

    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r}: use one of {SCHEMES} (compressed-tensors' NVFP4 presets).")
    experts = _fp4_experts(model, "export_fp4(format='compressed-tensors')")
    if scheme == "NVFP4" and calibration is None:
        raise ValueError(
            "scheme='NVFP4' (W4A4) needs per-tensor input global scales, calibrated on data: pass calibration= "
            "(token ids, or the HintBatch of recorded rollouts), or export weight-only with scheme='NVFP4A16'."
        )
    if scheme == "NVFP4A16" and calibration is not None:
        raise ValueError("scheme='NVFP4A16' is weight-only and takes no calibration; drop it or use scheme='NVFP4'.")
    stale = checkpoint_files(directory, overwrite)
    amax = calibrate_input_amax(model, calibration) if calibration is not None else None

    tensors: dict[str, torch.Tensor] = {}
    expert_bytes = 0
    for name, m in experts.items():
        for proj, q in zip(_PROJS, m.packed_weights()):
            e = q.packed.shape[0]
            names = [n for row in _per_expert(model, name, proj, q.packed.shape) for n in row]
            parts = 2 if proj == "gate_up_proj" else 1
            G = weight_global_scale(q.global_scale.reshape(e, 1, 1)).expand(e, parts, 1).contiguous()
            fields = {
                "weight_packed": _split(model, name, proj, q.packed.cpu()),
                "weight_scale": _split(model, name, proj, q.block_scale.cpu()),
                "weight_global_scale": _split(model, name, proj, G.cpu()),
            }
            if amax is not None:
                a_in, a_h = amax[name]
                inp = (a_in.expand(e) if proj == "gate_up_proj" else a_h).reshape(e, 1, 1)
                fields["input_global_scale"] = _split(model, name, proj, inp.expand(e, parts, 1).contiguous())
            for w in names:
                base = w.removesuffix(".weight")
                tensors[f"{base}.weight_packed"] = fields["weight_packed"][w]
                tensors[f"{base}.weight_scale"] = fields["weight_scale"][w].view(torch.float8_e4m3fn)
                tensors[f"{base}.weight_global_scale"] = fields["weight_global_scale"][w].reshape(1)
                if amax is not None:
                    tensors[f"{base}.input_global_scale"] = _input_global_scale(fields["input_global_scale"][w])
                expert_bytes += sum(tensors[f"{base}.{f}"].nbytes for f in fields)
    rest = _bf16_state(model, set(experts))
    if set(rest) & set(tensors):
        raise RuntimeError(f"Expert and dense weight names collide: {sorted(set(rest) & set(tensors))[:3]}.")
    remove_files(directory, stale)
    os.makedirs(directory, exist_ok=True)
    save_file({**rest, **tensors}, os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):  # trace_fp4's; compressed-tensors' is written below
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.dtype = torch.bfloat16
    config.save_pretrained(directory)
    ignore = _ignore_names(model, set(experts))
    ModelCompressor(quantization_config=_quantization_config(scheme, ignore)).update_config(directory)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    logger.warning(
        f"Wrote {directory}. Load it with trace_hf.export.load_fp4 (or serve it with vLLM or SGLang), not with "
        "transformers' AutoModelForCausalLM.from_pretrained: through 5.25.0 at least, transformers dequantizes "
        "NVFP4 MoE experts without their weight_global_scale, so they load 448 * 6 / amax times too large "
        "(huggingface/transformers#48371)."
    )
    return {"experts": expert_bytes, "other": sum(t.nbytes for t in rest.values())}


# ----------------------------------------------------------------------------------------------------------
# Load back
# ----------------------------------------------------------------------------------------------------------


def is_compressed_tensors_checkpoint(directory: str | os.PathLike) -> bool:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        qc = json.load(f).get("quantization_config") or {}
    return qc.get("quant_method") == FORMAT


def _check_scheme(qc: dict, directory) -> None:
    if qc.get("format") != CT_FORMAT:
        raise ValueError(
            f"{directory} is a compressed-tensors checkpoint in format {qc.get('format')!r}; trace-hf starts RL from "
            f"NVFP4 ({CT_FORMAT!r}) ones only: quantize the model to NVFP4 with llm-compressor, or load the BF16 "
            "model with TraceFP4Config."
        )
    for group in (qc.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", 16):
            raise ValueError(
                f"{directory}'s quantization scheme {w} is not NVFP4 (4-bit float, groups of 16); load the BF16 "
                "model with TraceFP4Config instead."
            )


class _Checkpoint:
    """The tensors of a (possibly sharded) safetensors checkpoint, read one at a time when asked for."""

    def __init__(self, directory):
        index = os.path.join(directory, WEIGHTS_FILE + ".index.json")
        if os.path.isfile(index):
            with open(index) as f:
                where = json.load(f)["weight_map"]
        else:
            with safe_open(os.path.join(directory, WEIGHTS_FILE), "pt") as f:
                where = dict.fromkeys(f.keys(), WEIGHTS_FILE)
        self._where = {k: os.path.join(directory, v) for k, v in where.items()}
        self._files = {}  # path -> open safetensors file (memory-mapped)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def __iter__(self):
        return iter(self._where)

    def path(self, key: str) -> str:
        return self._where[key]

    def __getitem__(self, key: str) -> torch.Tensor:
        path = self._where[key]
        if path not in self._files:
            self._files[path] = safe_open(path, "pt")
        return self._files[path].get_tensor(key)


#: Round-to-nearest interval of each E2M1 magnitude (index 1..7), as ratios |w| / (block scale * g).
_CODE_LO = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_CODE_HI = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])


def masters_of(q: fp4.FP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Master weights in `dtype` whose `fp4.quantize(..., scale="expert")` is `q` again, where `q` allows it.

    The dequantized values requantize to the same codes, but not always to the same scales: `fp4.quantize` sets a
    block's scale from its largest element (amax / 6), so a block whose largest code is below 6 (E4M3 rounded that
    scale, coarsely where it is subnormal) gets a smaller scale back, and the expert's global scale comes back from
    its largest element rounded to `dtype`. So each such block's largest element is moved, within its code's
    rounding interval, to where the block scale rounds back to the stored one; and each expert's largest element is
    moved (by a few `dtype` ulps) to where amax / (448 * 6) rounds back to `g`.
    """
    bs = 16
    codes = q.codes().long()
    mag = codes & 7
    s = fp4.e4m3_decode(q.block_scale)  # [E, N, nb]
    g = q.global_scale.float().reshape(-1, 1, 1)
    w = q.dequantize().unflatten(-1, (-1, bs))  # [E, N, nb, 16]
    top = mag.unflatten(-1, (-1, bs)).amax(-1)  # [E, N, nb]
    arg = mag.unflatten(-1, (-1, bs)).argmax(-1, keepdim=True)
    b = q.block_scale.long()
    down = fp4.e4m3_decode((b - 1).clamp(min=0).to(torch.uint8))
    up = fp4.e4m3_decode((b + 1).clamp(max=0x7E).to(torch.uint8))
    s_lo, s_hi = (s + down) / 2, torch.where(b >= 0x7E, torch.full_like(s, float("inf")), (s + up) / 2)
    lo = torch.maximum(_CODE_LO[top], 6 * s_lo / s.clamp(min=1e-30))
    hi = torch.minimum(_CODE_HI[top], 6 * s_hi / s.clamp(min=1e-30))
    fix = (top < 7) & (b > 0) & (lo < hi)
    sign = torch.where(w.gather(-1, arg).signbit(), -1.0, 1.0).squeeze(-1)
    moved = sign * (lo + hi) / 2 * s * g
    w = w.scatter(-1, arg, torch.where(fix, moved, w.gather(-1, arg).squeeze(-1)).unsqueeze(-1))
    w = w.flatten(-2).to(dtype)
    # The expert's largest element: the one at code 6 under scale 448 (where `fp4.quantize` put amax).
    flat = w.flatten(1)
    big = flat.float().abs().argmax(1)
    a = flat.gather(1, big[:, None]).squeeze(1)
    want = q.global_scale.float().reshape(-1)
    best = a
    for step in (1, -1, 2, -2):
        c = a.abs()
        for _ in range(abs(step)):
            c = torch.nextafter(c, torch.full_like(c, float("inf") if step > 0 else 0.0))
        ok_now = (best.abs().float() / torch.full_like(want, fp4.E2M1_MAX * fp4.E4M3_MAX)) == want
        ok = (c.float() / torch.full_like(want, fp4.E2M1_MAX * fp4.E4M3_MAX)) == want
        best = torch.where(~ok_now & ok, torch.where(a.signbit(), -c, c), best)
    flat = flat.scatter(1, big[:, None], best[:, None])
    return flat.reshape(w.shape)


def load_compressed_tensors(directory: str | os.PathLike, quantization_config=None, **from_pretrained_kwargs):
    """Load a compressed-tensors NVFP4 checkpoint with FP4 experts (`TraceFP4Config`) whose packed weights are the
    checkpoint's codes and scale bytes, to start RL from it.

    config.json names compressed-tensors, and `from_pretrained` refuses a second, different quantization config
    (it raises "The model is quantized with CompressedTensorsConfig but you are passing a TraceFP4Config"). So the
    model is built from the config without it, with `quantization_config` (default `TraceFP4Config()`), the dense
    weights load as usual, and the experts' packed tensors are installed afterwards with `load_packed_weights`
    (masters set to their dequantized values). Dense Linears the checkpoint holds in NVFP4 too (llm-compressor
    quantizes attention as well) are decompressed to the model dtype with compressed-tensors' own compressor.
    """
    require_compressed_tensors()
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from ..quant.config import TraceFP4Config

    config = from_pretrained_kwargs.pop("config", None) or AutoConfig.from_pretrained(directory)
    qc = getattr(config, "quantization_config", None)
    qc = qc.to_dict() if hasattr(qc, "to_dict") else qc
    if not qc or qc.get("quant_method") != FORMAT:
        raise ValueError(f"{directory} has no compressed-tensors quantization_config; load it with load_fp4.")
    _check_scheme(qc, directory)
    config = copy.deepcopy(config)
    del config.quantization_config
    quantization_config = quantization_config or TraceFP4Config()
    if quantization_config.fmt != "nvfp4":
        raise ValueError(
            f"{directory} holds NVFP4 experts; load it with TraceFP4Config(fmt='nvfp4'), not "
            f"fmt={quantization_config.fmt!r}."
        )
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # expert masters and NVFP4 dense weights are missing on purpose
    try:
        model = AutoModelForCausalLM.from_pretrained(
            directory, config=config, quantization_config=quantization_config, **from_pretrained_kwargs
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    experts = _fp4_experts(model, "load_fp4")
    state = _Checkpoint(directory)
    used = set()

    for name, m in experts.items():
        device, packed = m.gate_up_proj.device, []
        for proj in _PROJS:
            shape = m.gate_up_proj.shape if proj == "gate_up_proj" else m.down_proj.shape
            names = [n for row in _per_expert(model, name, proj, shape) for n in row]
            by_field = {}
            for f in ("weight_packed", "weight_scale", "weight_global_scale"):
                keys = [n.removesuffix(".weight") + "." + f for n in names]
                missing = [k for k in keys if k not in state]
                if missing:
                    raise ValueError(
                        f"{directory} lacks {len(missing)} expert tensors (first {missing[0]}): it is not an NVFP4 "
                        "checkpoint of this model's experts; copy it again or re-export."
                    )
                by_field[f] = [state[k] for k in keys]
                for k, t in zip(keys, by_field[f]):
                    _check_expert_tensor(t, k, state.path(k), m, proj)
                used.update(keys)
            e, parts = m.num_experts, len(names) // m.num_experts
            G = torch.stack([t.reshape(()) for t in by_field["weight_global_scale"]]).reshape(e, parts).float()
            if parts == 2 and not torch.equal(G[:, 0], G[:, 1]):
                raise ValueError(
                    f"{directory}: the gate and up projections of {name}'s experts have different global scales, "
                    "but trace-hf quantizes each expert's fused gate_up with one; quantize the model with gate/up "
                    "global scales fused (llm-compressor does so for fused layers), or load the BF16 model."
                )

            def fuse(ts):
                return torch.stack(ts).reshape(e, parts, *ts[0].shape).flatten(1, 2)

            packed.append(
                fp4.FP4Tensor(
                    fuse(by_field["weight_packed"]).to(device),
                    fuse([t.view(torch.uint8) for t in by_field["weight_scale"]]).to(device),
                    trace_global_scale(G[:, 0]).reshape(e, 1, 1).to(device),
                    "nvfp4",
                )
            )
        _install(m, name, packed)

    # Dense Linears stored in NVFP4 (not the experts): decompressed with compressed-tensors' compressor.
    dense = sorted(k.removesuffix(".weight_packed") for k in state if k.endswith(".weight_packed") and k not in used)
    if dense:
        scheme = QuantizationScheme.model_validate(next(iter(qc["config_groups"].values())))
        compressor = BaseCompressor.get_value_from_registry(CT_FORMAT)
        names = _revert_names(model)
        for base in dense:
            sd = {f: state[f"{base}.{f}"] for f in ("weight_packed", "weight_scale", "weight_global_scale")}
            w = compressor.decompress(sd, scheme)["weight"]
            target = names.get(base + ".weight")
            if target is None:
                raise ValueError(f"{directory} holds {base}, which this model does not have; re-export.")
            param = model.get_parameter(target)
            with torch.no_grad():
                param.copy_(w.to(param.dtype))
    return model.eval()


def _check_expert_tensor(t: torch.Tensor, key: str, path: str, m: TraceFP4Experts, proj: str) -> None:
    """One expert tensor of the checkpoint, checked against the experts module built from its config before the
    experts are stacked, where a mismatch would be torch's bare `stack` error naming neither file nor tensor."""
    rows, cols = (m.intermediate_dim, m.hidden_dim) if proj == "gate_up_proj" else (m.hidden_dim, m.intermediate_dim)
    field = key.rsplit(".", 1)[-1]
    if field == "weight_global_scale":
        ok, want = t.numel() == 1, "one value"
    else:
        shape = (rows, cols // 2) if field == "weight_packed" else (rows, cols // 16)
        ok, want = tuple(t.shape) == shape and t.element_size() == 1, f"shape {shape} of one-byte values"
    if not ok:
        raise ValueError(
            f"{path} holds {key} of shape {tuple(t.shape)} and dtype {t.dtype}, but the experts its config.json "
            f"describes ({m.num_experts} experts, hidden {m.hidden_dim}, width {m.intermediate_dim}) need {want}: "
            "the file is damaged or belongs to another model. Copy the checkpoint again (with its config.json), or "
            "re-export it."
        )


def _install(m: TraceFP4Experts, name: str, packed: list[fp4.FP4Tensor]) -> None:
    """The checkpoint's packed weights into `m`, with masters (`masters_of`) that re-quantize to them, so that the
    rollout's refresh from the masters keeps computing with the checkpoint's codes. Where they cannot (scale bytes
    `fp4.quantize` never writes), the packed weights stay the checkpoint's until the masters change, with a
    warning. Frozen experts (`freeze_experts`) hold only the packed weights: those are the checkpoint's, as they are."""
    m.load_packed_weights(*packed)
    if m.frozen:
        return
    with torch.no_grad():
        for param, q in zip((m.gate_up_proj, m.down_proj), packed):
            param.copy_(masters_of(q, param.dtype))
    again = [fp4.quantize(p.detach(), "nvfp4", scale="expert") for p in (m.gate_up_proj, m.down_proj)]
    off = sum(
        int(
            (a.block_scale != q.block_scale).sum()
            + (a.packed != q.packed).any(-1).sum()
            # an all-zero expert's global scale is immaterial (compressed-tensors stores 1 for it)
            + (
                (a.global_scale.float() != q.global_scale.float()).flatten() & (q.block_scale.flatten(1) != 0).any(1)
            ).sum()
        )
        for a, q in zip(again, packed)
    )
    if not off:
        m.refresh_packed()
        return
    m.load_packed_weights(*packed)
    logger.warning(
        f"{name}: {off} rows, blocks or experts of the checkpoint's FP4 experts re-quantize to other codes or scales "
        f"from any {m.weight_dtype} master weights (load with dtype=torch.float32, or with "
        "TraceFP4Config(freeze_experts=True), to keep them): the model computes with the checkpoint's codes until the "
        "next refresh from the masters (a rollout engine's, or an optimizer step) re-quantizes them."
    )


def _revert_names(model) -> dict[str, str]:
    """{original checkpoint name: model parameter name} of the model's 2-D dense weights."""
    params = {n: p for n, p in model.named_parameters() if p.ndim == 2}
    by_id = {id(p): n for n, p in params.items()}
    return {k: by_id[id(v)] for k, v in _revert(model, params).items() if id(v) in by_id}
