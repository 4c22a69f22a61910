# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The package list, which pyproject.toml cannot express: every subpackage of trace_hf/ by discovery, plus kernels/
installed as `trace_hf.kernels`.

The top-level name `kernels` belongs to the Hugging Face Kernels package (a transformers dependency), and the folder
has no `__init__.py` (kernels/README.md says why), so discovery alone would miss it. Everything else is in
pyproject.toml.
"""

from setuptools import find_packages, setup


setup(
    packages=[*find_packages(include=["trace_hf", "trace_hf.*"]), "trace_hf.kernels"],
    package_dir={"trace_hf.kernels": "kernels"},
)
