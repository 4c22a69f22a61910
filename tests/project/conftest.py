# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""What the study's tests share: examples/study/study.py loaded as a module."""

import importlib.util
import os

import pytest


PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def study(request):
    """examples/study/study.py, loaded afresh for each test module (its module-level state stays apart)."""
    path = os.path.join(PROJECT_ROOT, "examples", "study", "study.py")
    spec = importlib.util.spec_from_file_location(f"study_example_{request.module.__name__}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
