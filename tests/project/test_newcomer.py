# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""A newcomer's first hour: import from the source tree; inputs that crashed unclearly or passed silently."""

import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from trace_hf import TraceFP4Config, fp4, use_hints
from trace_hf.hints import StaleHintsWarning
from trace_hf.quant.experts import fp4_experts
from trace_hf.rollout import make_rollout
from trace_hf.testing import save_tiny_model


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_IMPORT = """
import importlib.util, os, sys
import trace_hf
import trace_hf.kernels.fp4_quant as k
root = os.path.realpath(sys.argv[1]) + os.sep
ours = os.path.join(root, "kernels") + os.sep
assert os.path.realpath(k.__file__) == os.path.join(root, "kernels", "fp4_quant.py"), k.__file__
# The top-level name `kernels` is the Hugging Face Kernels package's (a transformers dependency from 5.25), never this
# folder: if anything holds it, it comes from outside the clone. With the repository root on sys.path (the cwd of
# `python -c`, `python -m pytest`) and that package absent, kernels/ is at most a bare PEP 420 namespace there (no
# origin), which transformers recognises and ignores; without the root on sys.path it is not reachable at all.
if "kernels" in sys.modules:
    assert not os.path.realpath(getattr(sys.modules["kernels"], "__file__", None) or os.sep).startswith(ours)
spec = importlib.util.find_spec("kernels")
assert spec is None or spec.origin is None or not os.path.realpath(spec.origin).startswith(ours), spec
on_path = {os.path.realpath(p or os.getcwd()) + os.sep for p in sys.path}
if spec is not None and spec.origin is None and root not in on_path:
    assert not any(os.path.realpath(p).startswith(root) for p in spec.submodule_search_locations)
print(trace_hf.__file__)
"""


def _run(args, cwd, env=None):
    env = {**os.environ, **(env or {})}
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_import_from_the_repository_root_finds_kernels_beside_the_package():
    """`python -c ...` in the clone puts the source folder first on sys.path: trace_hf comes from trace_hf/ and
    must still find kernels/ as trace_hf.kernels (the source tree, not an install)."""
    out = _run(["-c", _IMPORT, ROOT], cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert os.path.realpath(out.stdout.strip()) == os.path.join(os.path.realpath(ROOT), "trace_hf", "__init__.py")


def test_import_with_the_source_folder_first_on_sys_path_from_elsewhere(tmp_path):
    """A notebook or script elsewhere with the clone first on sys.path (what `python -m pytest` in the root does)."""
    script = tmp_path / "probe.py"
    script.write_text(f"import sys\nsys.path.insert(0, {ROOT!r})\n" + _IMPORT)
    out = _run([str(script), ROOT], tmp_path)
    assert out.returncode == 0, out.stderr


def test_import_from_another_directory(tmp_path):
    """Whatever the install mode (this venv's), trace_hf and trace_hf.kernels come from the clone."""
    out = _run(["-c", _IMPORT, ROOT], cwd=tmp_path)
    assert out.returncode == 0, out.stderr


def test_python_m_pytest_from_the_root_imports_the_package(tmp_path):
    test = tmp_path / "test_probe.py"
    test.write_text("import trace_hf.kernels.fp4_quant as k\n\ndef test_probe():\n    assert k.quantize\n")
    out = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)], cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


# ----------------------------------------------------------------------------------------------------------
# Inputs that crashed unclearly or passed silently
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp4_model(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("tiny") / "m")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=TraceFP4Config())


SETTINGS = GenerationConfig(max_new_tokens=6, do_sample=True, eos_token_id=[3], pad_token_id=0)


@pytest.mark.parametrize("engine", ["generate", "engine"])
@pytest.mark.parametrize("bad", ["vocab", -1])
def test_prompt_ids_outside_the_vocabulary_name_the_row_and_id(fp4_model, engine, bad):
    vocab = fp4_model.get_input_embeddings().num_embeddings
    bad = vocab if bad == "vocab" else bad
    rollout = make_rollout(fp4_model, engine)
    with pytest.raises(ValueError, match=rf"row 1 holds token id {bad} at position 2, outside .*\[0, {vocab}\)"):
        rollout(fp4_model.eval(), [[4, 85, 54], [4, 85, bad, 56]], SETTINGS)


def test_prompts_that_encode_to_nothing_name_the_rows_and_the_tokenizer(fp4_model):
    # generate's path; the engine keeps its own check until a GPU run takes the shared one.
    rollout = make_rollout(fp4_model, "generate")
    with pytest.raises(ValueError, match=r"Prompts \[1\] of 2 encode to no tokens.*tokenizer.save_pretrained"):
        rollout(fp4_model.eval(), [[4, 85, 54], []], SETTINGS)


def test_use_hints_without_hints_says_they_were_not_recorded(fp4_model):
    rollout = make_rollout(fp4_model, "generate")
    out = rollout(fp4_model.eval(), [[4, 85, 54]], SETTINGS, record=False)
    assert out.hints is None
    mask = torch.ones(1, 3 + len(out.completion_ids[0]), dtype=torch.long)
    model = fp4_model.train()
    with pytest.raises(TypeError, match=r"not recorded .*record=False.*record=True"), use_hints(model, None, mask):
        pass


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(("shape", "scale"), [((0, 32), "tensor"), ((0, 32), "row"), ((3, 0, 32), "expert")])
def test_empty_tensors_quantize_to_empty_results(backend, fmt, shape, scale):
    x = torch.empty(shape)
    q = fp4.quantize(x, fmt, scale=scale, backend=backend)
    assert q.shape == x.shape and q.packed.numel() == 0
    assert q.dequantize().shape == x.shape
    assert fp4.fake_quantize(x, fmt, scale=scale, backend=backend).shape == x.shape


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(("written", "read"), [("nvfp4", "mxfp4"), ("mxfp4", "nvfp4")])
def test_dequantize_of_the_other_format_names_both(backend, written, read):
    q = fp4.quantize(torch.randn(4, 64), written, backend="torch")
    relabelled = fp4.FP4Tensor(q.packed, q.block_scale, q.global_scale, read)
    if backend == "triton":
        from trace_hf.kernels.fp4_quant import dequantize
    else:
        dequantize = fp4.dequantize
    with pytest.raises(ValueError, match=rf"fmt='{read}'.*written in {written}.*fmt='{written}'"):
        dequantize(relabelled)


def _hinted_forward(policy, trainer, prompts):
    out = make_rollout(policy, "generate")(policy.eval(), prompts, SETTINGS, record=True)
    rows = [p + c for p, c in zip(prompts, out.completion_ids, strict=True)]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    trainer.train()
    with torch.no_grad(), use_hints(trainer, out.hints, mask) as report:
        trainer(input_ids=ids, attention_mask=mask)
    return report


def test_hints_of_another_policy_warn_once_naming_staleness(fp4_model, tmp_path):
    prompts = [[4, 85, 54, 12], [4, 85, 55, 56, 9], [7, 8, 9, 10], [11, 12, 13, 14]] * 4
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = _hinted_forward(fp4_model, fp4_model, prompts)
    assert not [w for w in caught if w.category is StaleHintsWarning], report.as_metrics()
    other = AutoModelForCausalLM.from_pretrained(
        save_tiny_model(tmp_path / "other", seed=1000), dtype=torch.bfloat16, quantization_config=TraceFP4Config()
    )
    with pytest.warns(StaleHintsWarning, match="max_version_diff") as caught:
        report = _hinted_forward(fp4_model, other, prompts)
        _hinted_forward(fp4_model, other, prompts)  # once per model
    assert len([w for w in caught if w.category is StaleHintsWarning]) == 1
    assert report.routing_mismatch > 0.5 or report.hint_flip_rate > 0.4


def test_data_edits_of_the_masters_reach_the_training_forward(fp4_model):
    """`.data` writes bump no version counter; the training forward still computes with the edited masters."""
    model = copy.deepcopy(fp4_model).train()
    ids = torch.tensor([[4, 85, 54, 12, 9, 10]])
    with torch.no_grad():
        model(input_ids=ids)  # fills the cached fake-quantized weights
        m = fp4_experts(model)[0]
        version = m.gate_up_proj._version
        m.gate_up_proj.data.copy_(m.gate_up_proj.data.flip(0))  # a weight sync through .data
        m.down_proj.data.mul_(1.5)
        assert m.gate_up_proj._version == version  # the reason a version check alone cannot see it
        stale_free = model(input_ids=ids).logits
        fresh = copy.deepcopy(model)
        for e in fp4_experts(fresh):
            e.invalidate_packed()
        torch.testing.assert_close(stale_free, fresh(input_ids=ids).logits, rtol=0, atol=0)
