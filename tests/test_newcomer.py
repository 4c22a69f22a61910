# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""A newcomer's first hour (issue 28): import from the source tree."""

import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_IMPORT = """
import importlib.util, os, sys
import trace_hf
import trace_hf.kernels.fp4_quant as k
root = os.path.realpath(sys.argv[1]) + os.sep
assert os.path.realpath(k.__file__) == os.path.join(root, "kernels", "fp4_quant.py"), k.__file__
assert "kernels" not in sys.modules, "trace_hf registered a top-level `kernels`"
spec = importlib.util.find_spec("kernels")
# With the repository root on sys.path (the cwd of `python -c`, `python -m pytest`) kernels/ is a bare PEP 420
# namespace there (no origin), which transformers recognises and ignores; it is never a real module, and without
# the root on sys.path it is not reachable at all.
assert spec is None or spec.origin is None, spec
if root not in {os.path.realpath(p or os.getcwd()) + os.sep for p in sys.path}:
    assert spec is None or not any(os.path.realpath(p).startswith(root) for p in spec.submodule_search_locations)
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
