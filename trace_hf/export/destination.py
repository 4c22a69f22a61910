# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Where an export may write: a new or empty directory, or one whose earlier checkpoint the caller lets it replace.

Loaders read a directory's weights through whatever index and files they find there: `load_fp4` of a
compressed-tensors checkpoint prefers a sharded one's `model.safetensors.index.json`, transformers a single
`model.safetensors`. An export written beside an earlier checkpoint therefore loads as a mix of two policies. So
`export_fp4` refuses a directory that holds checkpoint files, before any calibration forward, unless
`overwrite=True`, which deletes them just before writing.
Other files (a tokenizer, notes, logs) are left alone.
"""

from __future__ import annotations

import fnmatch
import os


#: Files a loader may read as (part of) the model: weights (sharded or not), their indices, the configs, a PEFT
#: adapter (transformers loads one it finds onto its base model).
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model*.safetensors",
    "model*.safetensors.index.json",
    "experts.fp4.safetensors",
    "pytorch_model*.bin",
    "pytorch_model*.bin.index.json",
    "adapter_config.json",
    "adapter_model*",
)


def checkpoint_files(directory: str | os.PathLike, overwrite: bool) -> list[str]:
    """The checkpoint files already in `directory` (for `remove_files` to delete before writing); raises when the
    path is a file, or holds any and `overwrite` is off."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise FileExistsError(
            f"export_fp4: {directory} is a file, not a directory; give the path of a new or empty directory."
        )
    if not os.path.isdir(directory):
        return []
    found = sorted(
        name
        for name in os.listdir(directory)
        if os.path.isfile(os.path.join(directory, name)) and any(fnmatch.fnmatch(name, p) for p in CHECKPOINT_FILES)
    )
    if found and not overwrite:
        raise FileExistsError(
            f"export_fp4: {directory} already holds a checkpoint ({', '.join(found[:5])}"
            f"{', ...' if len(found) > 5 else ''}). Written beside it, the export would load as a mix of both models "
            "(loaders still read the old index and weight files). Export into a new or empty directory, or pass "
            "overwrite=True to delete these files first."
        )
    return found


def remove_files(directory: str | os.PathLike, names: list[str]) -> None:
    for name in names:
        os.remove(os.path.join(directory, name))
