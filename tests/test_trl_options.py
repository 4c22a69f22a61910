# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""TRL's GRPOConfig options with TraceGRPOTrainer: each works (a short run on the tiny model) or is refused at
construction with an error that names the field and the alternative; and config defaults that warn about nothing."""

import warnings

import pytest


# 5. Config defaults
# ----------------------------------------------------------------------------------------------------------


def _config_warnings(**kwargs):
    from trace_hf import TraceGRPOConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = TraceGRPOConfig(output_dir="x", report_to="none", use_cpu=True, **kwargs)
    return config, [str(w.message) for w in caught]


def test_plain_config_warns_about_nothing_checkpointing():
    config, caught = _config_warnings()
    assert not [m for m in caught if "checkpointing" in m], caught
    assert config.activation_checkpointing is True  # TRL's default (memory for large models), now without a warning


@pytest.mark.parametrize("on", [True, False])
def test_explicit_gradient_checkpointing_still_works(on):
    """transformers 5 renamed it to activation_checkpointing; a user passing the old name still gets it (and the
    deprecation warning transformers gives for the old name)."""
    config, caught = _config_warnings(gradient_checkpointing=on)
    assert config.activation_checkpointing is on
    assert any("gradient_checkpointing" in m for m in caught), caught


@pytest.mark.parametrize("on", [True, False])
def test_activation_checkpointing_warns_about_nothing(on):
    config, caught = _config_warnings(activation_checkpointing=on)
    assert config.activation_checkpointing is on
    assert not [m for m in caught if "checkpointing" in m], caught
