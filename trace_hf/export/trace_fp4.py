# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Export a trained policy with packed FP4 experts for deployment, and load it back.

The directory holds `config.json` (with the `trace_fp4` quantization_config), `model.safetensors` with every
non-expert weight, and `experts.fp4.safetensors` with each experts module's packed codes, block-scale bytes and
global scales (the same `FP4Tensor` fields the rollout path computes with). The BF16 expert masters are not
written: loading sets them to the dequantized FP4 values.

The experts file's metadata identifies the export (format version, FP4 format, the config fields that fix the
experts' shapes, an id shared with `model.safetensors`) and holds a SHA-256 of every tensor; `load_fp4` checks
all of it before installing anything, so a corrupted file, another model's experts or an edited config.json fail
with an error that says what to restore instead of loading and computing something else.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers.utils import logging

from .. import fp4
from ..quant.experts import TraceFP4Experts
from .destination import checkpoint_files, remove_files


logger = logging.get_logger(__name__)

EXPERTS_FILE = "experts.fp4.safetensors"
WEIGHTS_FILE = "model.safetensors"
EXPORT_FORMAT = "trace_hf.export_fp4/1"
_FIELDS = ("packed", "block_scale", "global_scale")
_PROJS = ("gate_up_proj", "down_proj")
#: Config fields (of the text config) that fix what the experts file must hold.
_IDENTITY = (
    "model_type", "hidden_size", "moe_intermediate_size", "num_experts", "num_local_experts", "n_routed_experts",
    "num_hidden_layers", "vocab_size",
)  # fmt: skip


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _identity(config) -> dict:
    text = config.get_text_config(decoder=True)
    return {k: getattr(text, k) for k in _IDENTITY if getattr(text, k, None) is not None}


def _merged_state(model) -> dict[str, torch.Tensor]:
    """The plain model's state dict, with the active PEFT LoRA adapters merged into their linears' weights (the
    model itself is left as it is): what the policy computes, under the names a plain checkpoint has."""
    from ..models import lora_weight

    lora = {name: m for name, m in model.named_modules() if getattr(m, "base_layer", None) is not None}
    out = {}
    for k, v in model.state_dict().items():
        if ".lora_" in k:
            continue
        out[k.replace(".base_layer.", ".")] = v
    for name, m in lora.items():
        out[f"{name}.weight"] = lora_weight(m).detach()
    return out


def _unique_state(model, skip: set[str]) -> dict[str, torch.Tensor]:
    """The state dict without `skip` and without second names of one tensor (tied embeddings): safetensors
    refuses shared tensors, and `from_pretrained` ties them again from the config."""
    out, seen = {}, set()
    for k, v in _merged_state(model).items():
        if k in skip:
            continue
        key = (v.device, v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), tuple(v.stride()))
        if v.numel() and key in seen:
            continue
        seen.add(key)
        out[k] = v.detach().contiguous().cpu()
    return out


def export_fp4(
    model, directory: str | os.PathLike, format: str = "trace_fp4", overwrite: bool = False, **options
) -> dict[str, int]:
    """Write the packed export of a `TraceFP4Config` model; returns the bytes of experts and other weights.

    `format="trace_fp4"` (trace-hf's own, read by `load_fp4`); `format="compressed-tensors"`: the NVFP4 checkpoint
    vLLM, SGLang and transformers load, with `options` (`scheme`, `calibration`, `tokenizer`) as in
    `trace_hf.export.compressed.export_compressed_tensors`. For `"trace_fp4"` a PEFT model is exported with its LoRA
    adapters merged into the dense weights (the experts are FP4 already).

    `directory` must be new or hold no checkpoint files (`trace_hf.export.destination`): an export beside another
    checkpoint would load as a mix of both. `overwrite=True` deletes those files just before writing.
    """
    from accelerate.utils import is_peft_model

    if format == "compressed-tensors":
        if is_peft_model(model):
            raise ValueError(
                "export_fp4(format='compressed-tensors') takes a plain model: merge the LoRA adapters first with "
                "`model = model.merge_and_unload()` (PEFT), or export with format='trace_fp4', which merges them itself."
            )
        from .compressed import export_compressed_tensors

        return export_compressed_tensors(model, directory, overwrite=overwrite, **options)
    if format != "trace_fp4":
        raise ValueError(f"export_fp4(format={format!r}): use 'trace_fp4' or 'compressed-tensors'.")
    if options:
        raise TypeError(f"export_fp4(format='trace_fp4') takes no {sorted(options)}; they are compressed-tensors'.")
    if is_peft_model(model):
        model = model.get_base_model()
    experts = {n: m for n, m in model.named_modules() if isinstance(m, TraceFP4Experts)}
    if not experts:
        raise ValueError("export_fp4 needs a model loaded with quantization_config=TraceFP4Config().")
    stale = checkpoint_files(directory, overwrite)
    packed = {}
    for name, m in experts.items():
        for pname, q in zip(_PROJS, m.packed_weights()):
            for f in _FIELDS:
                packed[f"{name}.{pname}.{f}"] = getattr(q, f).contiguous().cpu()
    fmts = {m.fmt for m in experts.values()}
    if len(fmts) != 1:
        raise ValueError(f"export_fp4 writes one FP4 format per model, but the experts use {sorted(fmts)}.")
    export_id = uuid.uuid4().hex
    metadata = {
        "format": "pt",
        "trace_hf_export": EXPORT_FORMAT,
        "fmt": fmts.pop(),
        "export_id": export_id,
        "config": json.dumps(_identity(model.config), sort_keys=True),
        "sha256": json.dumps({k: _sha256(v) for k, v in packed.items()}, sort_keys=True),
    }
    # Frozen experts keep their packed weights as buffers beside the codes; the experts file holds all of them.
    suffixes = ("", "_block_scale", "_global_scale")
    rest = _unique_state(model, {f"{n}.{p}{s}" for n in experts for p in _PROJS for s in suffixes})
    remove_files(directory, stale)
    os.makedirs(directory, exist_ok=True)
    save_file(packed, os.path.join(directory, EXPERTS_FILE), metadata=metadata)
    save_file(rest, os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt", "export_id": export_id})
    model.config.save_pretrained(directory)
    return {
        "experts": sum(t.numel() * t.element_size() for t in packed.values()),
        "other": sum(t.numel() * t.element_size() for t in rest.values()),
    }


def _metadata(path: str) -> dict:
    with safe_open(path, "pt") as f:
        return f.metadata() or {}


def _check_config(directory, meta: dict, from_pretrained_kwargs: dict) -> None:
    """Before building anything: config.json (or the `config` passed) must describe the exported model."""
    from transformers import AutoConfig

    config = from_pretrained_kwargs.get("config")
    if config is None or isinstance(config, (str, os.PathLike)):
        config = AutoConfig.from_pretrained(config or directory)
    qc = from_pretrained_kwargs.get("quantization_config") or getattr(config, "quantization_config", None)
    qc = qc.to_dict() if hasattr(qc, "to_dict") else qc
    if not qc or qc.get("quant_method") != "trace_fp4":
        raise ValueError(
            f"{directory}'s config has no trace_fp4 quantization_config, so the model would load without FP4 experts "
            f"(and random expert weights); restore config.json from the export (quantization_config with "
            f"quant_method='trace_fp4', fmt={meta['fmt']!r})."
        )
    if qc.get("fmt", "nvfp4") != meta["fmt"]:
        raise ValueError(
            f"config.json's quantization_config says fmt={qc.get('fmt')!r}, but {EXPERTS_FILE} was exported in "
            f"{meta['fmt']!r}; set quantization_config.fmt={meta['fmt']!r} again (the packed codes cannot change "
            f"format), or re-export from a model loaded with fmt={qc.get('fmt')!r}."
        )
    exported, now = json.loads(meta["config"]), _identity(config)
    diff = {k: (v, now.get(k)) for k, v in exported.items() if k in now and now[k] != v}
    if diff:
        shown = ", ".join(f"{k}: exported {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise ValueError(
            f"{EXPERTS_FILE} was exported from another model than the config describes ({shown}); restore "
            f"config.json from the export, or export this model with export_fp4."
        )


def _check_experts(model, packed: dict[str, torch.Tensor], meta: dict, directory) -> dict[str, TraceFP4Experts]:
    """The model's FP4 experts modules, once every tensor matches its checksum and the module's shape."""
    checksums = json.loads(meta["sha256"])
    if set(checksums) != set(packed):
        raise ValueError(
            f"{EXPERTS_FILE} in {directory} does not hold the tensors it lists: copy it again or re-export."
        )
    bad = [k for k, t in packed.items() if _sha256(t) != checksums[k]]
    if bad:
        raise ValueError(
            f"{EXPERTS_FILE} in {directory} is corrupted: {len(bad)} tensors fail their SHA-256 (first {bad[0]}); "
            f"copy the file again from the export, or re-export."
        )
    experts = {n: m for n, m in model.named_modules() if isinstance(m, TraceFP4Experts)}
    names = {k.rsplit(".", 2)[0] for k in packed}
    if names != set(experts):
        raise ValueError(
            f"{EXPERTS_FILE} does not fit the FP4 experts of the model built from the config (missing in the file: "
            f"{sorted(set(experts) - names)[:4]}, not in the model: {sorted(names - set(experts))[:4]}); load with "
            f"the exported config.json and its modules_to_not_convert, or re-export."
        )
    for name, m in experts.items():
        bs = fp4.get_format(m.fmt).block_size
        e, h, i = m.num_experts, m.hidden_dim, m.intermediate_dim
        want = {
            "gate_up_proj": {"packed": (e, 2 * i, h // 2), "block_scale": (e, 2 * i, h // bs)},
            "down_proj": {"packed": (e, h, i // 2), "block_scale": (e, h, i // bs)},
        }
        for p, fields in want.items():
            for f, shape in fields.items():
                got = tuple(packed[f"{name}.{p}.{f}"].shape)
                if got != shape:
                    raise ValueError(
                        f"{EXPERTS_FILE} holds {name}.{p}.{f} of shape {got}, but the model built from the config "
                        f"has experts of width {i} (hidden {h}, {e} experts), which need {shape}; load with the "
                        f"exported config.json (moe_intermediate_size, hidden_size, number of experts), or re-export."
                    )
    return experts


def load_fp4(directory: str | os.PathLike, **from_pretrained_kwargs):
    """Load an `export_fp4` directory; its rollout path then computes with exactly the exported codes.

    Checks first that config.json still describes the export, then that the experts file belongs to this export's
    `model.safetensors`, is intact (SHA-256 per tensor) and fits the model built. `from_pretrained` loads the
    non-expert weights (the experts' masters are absent from the file, which it reports as missing); the packed
    experts are installed afterwards. A compressed-tensors NVFP4 checkpoint (`export_fp4(format="compressed-tensors")`
    or llm-compressor's) loads through `trace_hf.export.compressed.load_compressed_tensors`.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from .compressed import is_compressed_tensors_checkpoint, load_compressed_tensors

    if is_compressed_tensors_checkpoint(directory):
        return load_compressed_tensors(directory, **from_pretrained_kwargs)
    experts_path, weights_path = os.path.join(directory, EXPERTS_FILE), os.path.join(directory, WEIGHTS_FILE)
    meta = _metadata(experts_path)
    legacy = meta.get("trace_hf_export") is None
    if legacy:
        logger.warning(
            f"{experts_path} was written by an older trace-hf without checksums or identity; it cannot be checked. "
            "Re-export it with export_fp4 to get both."
        )
    elif meta["trace_hf_export"] != EXPORT_FORMAT:
        raise ValueError(
            f"{experts_path} has export format {meta['trace_hf_export']!r}; this trace-hf reads {EXPORT_FORMAT!r}: "
            "use the trace-hf version that wrote it, or re-export."
        )
    else:
        _check_config(directory, meta, from_pretrained_kwargs)
        if _metadata(weights_path).get("export_id") != meta["export_id"]:
            raise ValueError(
                f"{EXPERTS_FILE} and {WEIGHTS_FILE} in {directory} come from another export each (their export ids "
                f"differ): copy both files (and config.json) from one export_fp4 directory, or re-export."
            )
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the expert masters are missing on purpose
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, **from_pretrained_kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    packed = load_file(experts_path)
    if legacy:
        experts = {n: m for n, m in model.named_modules() if isinstance(m, TraceFP4Experts)}
    else:
        experts = _check_experts(model, packed, meta, directory)
    for name, m in experts.items():
        device = next(m.buffers() if m.frozen else m.parameters()).device
        gu, d = (fp4.FP4Tensor(*(packed[f"{name}.{p}.{f}"].to(device) for f in _FIELDS), m.fmt) for p in _PROJS)
        m.load_packed_weights(gu, d)
    return model.eval()
