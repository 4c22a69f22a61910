# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Export a trained policy with packed FP4 experts for deployment, and load it back.

The directory holds `config.json` (with the `trace_fp4` quantization_config), `model.safetensors` with every
non-expert weight, and `experts.fp4.safetensors` with each experts module's packed codes, block-scale bytes and
global scales (the same `FP4Tensor` fields the rollout path computes with). The BF16 expert masters are not
written: loading sets them to the dequantized FP4 values.
"""

from __future__ import annotations

import os

from safetensors.torch import load_file, save_file

from . import fp4
from .experts import TraceFP4Experts


EXPERTS_FILE = "experts.fp4.safetensors"
WEIGHTS_FILE = "model.safetensors"
_FIELDS = ("packed", "block_scale", "global_scale")


def export_fp4(model, directory: str | os.PathLike) -> dict[str, int]:
    """Write the packed export of a `TraceFP4Config` model; returns the bytes of experts and other weights."""
    experts = {n: m for n, m in model.named_modules() if isinstance(m, TraceFP4Experts)}
    if not experts:
        raise ValueError("export_fp4 needs a model loaded with quantization_config=TraceFP4Config().")
    os.makedirs(directory, exist_ok=True)
    packed, fmt = {}, None
    for name, m in experts.items():
        for pname, q in zip(("gate_up_proj", "down_proj"), m.packed_weights()):
            for f in _FIELDS:
                packed[f"{name}.{pname}.{f}"] = getattr(q, f).contiguous().cpu()
        fmt = m.fmt
    expert_params = {f"{n}.{p}" for n in experts for p in ("gate_up_proj", "down_proj")}
    rest = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k not in expert_params}
    save_file(packed, os.path.join(directory, EXPERTS_FILE), metadata={"fmt": fmt})
    save_file(rest, os.path.join(directory, WEIGHTS_FILE))
    model.config.save_pretrained(directory)
    return {
        "experts": sum(t.numel() * t.element_size() for t in packed.values()),
        "other": sum(t.numel() * t.element_size() for t in rest.values()),
    }


def load_fp4(directory: str | os.PathLike, **from_pretrained_kwargs):
    """Load an `export_fp4` directory; its rollout path then computes with exactly the exported codes.

    `from_pretrained` loads the non-expert weights (the experts' masters are absent from the file, which it
    reports as missing); the packed experts are installed afterwards.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the expert masters are missing on purpose
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, **from_pretrained_kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    packed = load_file(os.path.join(directory, EXPERTS_FILE))
    for name, m in model.named_modules():
        if isinstance(m, TraceFP4Experts):
            device = m.gate_up_proj.device
            gu, d = (
                fp4.FP4Tensor(*(packed[f"{name}.{p}.{f}"].to(device) for f in _FIELDS), m.fmt)
                for p in ("gate_up_proj", "down_proj")
            )
            m.load_packed_weights(gu, d)
    return model.eval()
