# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Where `export_fp4` writes, in both formats: a directory holding an earlier checkpoint is refused before any
calibration forward (an export beside it would load as a mix of both policies), `overwrite=True` replaces that
checkpoint's files and keeps the rest, and a path that is a file is refused up front (CPU, tiny models)."""

import os

import pytest
import torch


pytest.importorskip("compressed_tensors")

from trace_hf import TraceFP4Config  # noqa: E402
from trace_hf.export import compressed, export_fp4, load_fp4  # noqa: E402
from trace_hf.quant.quantizer import quantize_model  # noqa: E402
from trace_hf.testing import build_char_tokenizer, tiny_model  # noqa: E402


FORMATS = {"trace_fp4": {}, "compressed-tensors": {"scheme": "NVFP4A16"}}


@pytest.fixture(scope="module")
def model():
    return quantize_model(tiny_model(), TraceFP4Config())


@pytest.fixture
def no_calibration(monkeypatch):
    """Fail the test if a calibration forward runs: the destination must be checked first."""

    def boom(*args, **kwargs):
        raise AssertionError("calibration ran before the destination was checked")

    monkeypatch.setattr(compressed, "calibrate_input_amax", boom)


def ids():
    return torch.randint(4, 40, (2, 10), generator=torch.Generator().manual_seed(0))


def logits(path):
    with torch.no_grad():
        return load_fp4(path)(ids()).logits


def sharded_checkpoint(path):
    """Another model's sharded checkpoint (`model.safetensors.index.json` and its shards) and a tokenizer."""
    tiny_model(seed=1).save_pretrained(path, max_shard_size="500KB")
    build_char_tokenizer().save_pretrained(path)
    assert (path / "model.safetensors.index.json").is_file()
    return sorted(os.listdir(path))


@pytest.mark.parametrize("fmt", FORMATS)
def test_directory_with_a_checkpoint_is_refused_then_overwritten(model, fmt, tmp_path):
    fresh = tmp_path / "fresh"
    export_fp4(model, fresh, format=fmt, **FORMATS[fmt])
    stale = tmp_path / "stale"
    before = sharded_checkpoint(stale)
    with pytest.raises(FileExistsError, match=r"already holds a checkpoint \(config\.json.*overwrite=True"):
        export_fp4(model, stale, format=fmt, **FORMATS[fmt])
    assert sorted(os.listdir(stale)) == before  # nothing written or deleted
    export_fp4(model, stale, format=fmt, overwrite=True, **FORMATS[fmt])
    left = set(os.listdir(stale))
    assert "model.safetensors.index.json" not in left and not any(n.startswith("model-0") for n in left)
    assert "tokenizer_config.json" in left  # not a checkpoint file: kept
    assert torch.equal(logits(stale), logits(fresh))


def test_checkpoint_is_refused_before_calibration(model, tmp_path, no_calibration):
    sharded_checkpoint(tmp_path / "stale")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_fp4(model, tmp_path / "stale", format="compressed-tensors", calibration=ids())


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_file_is_refused_before_calibration(model, fmt, tmp_path, no_calibration):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"not a directory")
    options = {"calibration": ids()} if fmt == "compressed-tensors" else {}
    with pytest.raises(FileExistsError, match=r"weights\.bin is a file, not a directory"):
        export_fp4(model, path, format=fmt, **options)
    assert path.read_bytes() == b"not a directory"


def test_a_directory_without_a_checkpoint_is_written(model, tmp_path):
    build_char_tokenizer().save_pretrained(tmp_path / "out")
    export_fp4(model, tmp_path / "out")
    written = set(os.listdir(tmp_path / "out"))
    assert {"tokenizer_config.json", "model.safetensors", "experts.fp4.safetensors"} <= written
