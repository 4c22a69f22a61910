# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Shared pytest setup."""

from __future__ import annotations

import os

import pytest
import torch


# Triton reads TRITON_INTERPRET when a kernel is decorated: set it before anything imports triton, so that the
# kernels run on CPU here and compiled on a GPU machine.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist's workers share the cores: each takes its part of torch's threads instead of all of them (two workers of
# two threads each on 2 cores ran tests/quant, hints and export in 96 s; of one thread each, in 67 s).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))


@pytest.fixture(autouse=True)
def _seeded():
    """Each test's unseeded draws (``torch.randn`` on CPU and CUDA) are the same whichever tests ran before it: a
    tolerance that a rare FP4 code flip can cross must not pass or fail with the test order."""
    torch.manual_seed(0)


def pytest_configure(config):
    # trace_hf silences this at import, but pytest restores the warning filters around collection and each test.
    # TRL reads the deprecated `is_gradient_checkpointing`; no test (or user) causes it.
    config.addinivalue_line("filterwarnings", "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
    # Triton's interpreter divides with numpy: the NVFP4 block scale of an all-zero row (padding rows the kernel masks
    # out afterwards) is 0/0 there, a NaN that is never stored. Compiled kernels warn about nothing.
    config.addinivalue_line("filterwarnings", "ignore:invalid value encountered in divide:RuntimeWarning")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
        return
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    # A GPU machine compiles the kernels, so a test's cpu case (the interpreter's) cannot run them: skip it, saying how.
    skip = pytest.mark.skip(reason="a cpu case: kernels run on CPU only under TRITON_INTERPRET=1 (the CPU tests)")
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(str(params.get(name)) == "cpu" for name in ("dev", "device")):
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """cuda when there is one, else cpu (Triton kernels then run under TRITON_INTERPRET=1)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one thread is several times faster than two on a shared 2-core machine (modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def batch_invariant(monkeypatch):
    """Every dense product (transformers' and the engine's, its batch-1 `gemv` included) computed one row at a time:
    a row's result no longer depends on how many rows share the product (the CPU's BLAS, like cuBLAS, may sum a row
    otherwise in a product of another row count)."""
    import torch.nn.functional as F

    from trace_hf.kernels import decode_ops
    from trace_hf.rollout.engine import FastDecoder

    linear = F.linear

    def by_row(x, w, b=None):
        rows = x.reshape(-1, x.shape[-1])
        out = torch.cat([linear(r, w, b) for r in rows.split(1)]) if rows.shape[0] else linear(rows, w, b)
        return out.view(*x.shape[:-1], w.shape[0])

    monkeypatch.setattr(F, "linear", by_row)
    monkeypatch.setattr(decode_ops, "linear", by_row)
    monkeypatch.setattr(FastDecoder, "_lm_head", lambda dec, xn: dec.logits.copy_(by_row(xn, dec.w.lm_head)))


@pytest.fixture(scope="session")
def gluon_sass_counts() -> list[dict]:
    """The Gluon kernels' sm_90 loop counts (`sass_counts.gluon_counts`, run in a clean process), or a skip where this
    Triton has no bundled ptxas or no Gluon MMA layouts."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this Triton has no bundled ptxas")
    pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere")
    from benchmarks.kernels import sass_counts

    return sass_counts.run_clean()


_ENGINE_GRPO_METRICS = (
    "trace/hint_flip_rate", "trace/routing_mismatch", "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max", "trace/kl_rollout_train", "trace/hint_bytes_per_token",
    "sampling/importance_sampling_ratio/mean", "trace/hint_coverage", "trace/rollout/tokens_per_second",
    "trace/train/hint_flip_rate",
)  # fmt: skip


@pytest.fixture
def engine_grpo_metrics() -> tuple[str, ...]:
    """The metrics an engine-rollout GRPO step must log (`engine_grpo_step`)."""
    return _ENGINE_GRPO_METRICS


@pytest.fixture
def engine_grpo_step(tmp_path):
    """One TraceGRPOTrainer step of a model with `rollout_engine="engine"` (CPU, eager): returns the trainer, the
    logged metric names and the names of the parameters that changed. Keyword arguments override the config."""

    def run(model, **config):
        from datasets import Dataset

        from trace_hf import TraceGRPOConfig, TraceGRPOTrainer
        from trace_hf import testing as T

        ds = Dataset.from_dict({"prompt": ["Q: 1+2\nA:", "Q: 3+3\nA:"]})
        args = TraceGRPOConfig(
            output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_generations=2,
            max_completion_length=3, max_steps=1, learning_rate=1e-2, logging_steps=1, save_strategy="no",
            report_to="none", use_cpu=True, bf16=False, disable_tqdm=True, rollout_engine="engine", seed=0,
            **config,
        )  # fmt: skip
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer = TraceGRPOTrainer(model, lambda completions, **kw: [float(len(c)) for c in completions], args=args,
                                   train_dataset=ds, processing_class=T.build_char_tokenizer())  # fmt: skip
        trainer.train()
        logged = {k for h in trainer.state.log_history for k in h}
        changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
        return trainer, logged, changed

    return run
