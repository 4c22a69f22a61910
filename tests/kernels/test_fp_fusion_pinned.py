# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Every launch of a ``@triton.jit`` or ``@gluon.jit`` kernel passes ``enable_fp_fusion`` (kernels/README.md, "FMA
contraction is pinned at every launch"): Triton 3.10 turns FMA contraction off by default, so a launch that takes the
default would compile differently from how it was measured and tested (False where the torch reference must be
matched bit for bit, True elsewhere). Read from the source with `ast`; nothing is compiled."""

from __future__ import annotations

import ast
import pathlib


ROOT = pathlib.Path(__file__).resolve().parents[2]


def _jitted(fn: ast.FunctionDef) -> bool:
    return any(getattr(getattr(d, "func", d), "attr", None) == "jit" for d in fn.decorator_list)


def unpinned(trees: dict[str, ast.Module]) -> tuple[list[str], int]:
    """(``file:line kernel`` of each launch without ``enable_fp_fusion``, the number of launches). The option counts
    as a keyword or as a key of a dict literal assigned in the same function and passed as ``**name``."""
    names = {n.name for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.FunctionDef) and _jitted(n)}
    missing, launches = [], 0
    for path, tree in trees.items():
        scope = {n: fn for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) for n in ast.walk(fn)}  # innermost
        for call in ast.walk(tree):
            kernel = getattr(call, "func", None)
            kernel = kernel.value if isinstance(kernel, ast.Subscript) else None
            if not isinstance(call, ast.Call) or getattr(kernel, "id", getattr(kernel, "attr", None)) not in names:
                continue
            launches += 1
            dicts = {a.targets[0].id: a.value for a in ast.walk(scope.get(call, tree)) if isinstance(a, ast.Assign)
                     and isinstance(a.targets[0], ast.Name) and isinstance(a.value, ast.Dict)}  # fmt: skip
            keys = {k.arg for k in call.keywords} | {
                key.value for k in call.keywords if k.arg is None and isinstance(k.value, ast.Name)
                for key in getattr(dicts.get(k.value.id), "keys", []) if isinstance(key, ast.Constant)
            }  # fmt: skip
            if "enable_fp_fusion" not in keys:
                missing.append(f"{path}:{call.lineno} {ast.unparse(kernel)}")
    return missing, launches


def test_every_kernel_launch_pins_fp_fusion():
    files = sorted(ROOT.glob("kernels/*.py")) + sorted(ROOT.glob("trace_hf/**/*.py"))
    trees = {str(f.relative_to(ROOT)): ast.parse(f.read_text()) for f in files}
    missing, launches = unpinned(trees)
    assert launches >= 30, f"found only {launches} kernel launches: has the launch syntax changed?"
    assert not missing, f"pass enable_fp_fusion (True unless bit-exact; kernels/README.md): {missing}"
    # The check itself: a new launch without the option is caught.
    added = ast.parse("import triton\n@triton.jit\ndef k(x): pass\ndef f(x):\n    k[(1,)](x, num_warps=4)\n")
    assert unpinned({"new.py": added}) == (["new.py:5 k"], 1)
