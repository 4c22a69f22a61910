# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The engine's weights under FSDP2 (`ShardedWeights`: full copies gathered one layer at a time through the family's
layout map), on CPU: one gloo rank, a child process (it owns the process group), the Triton interpreter."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest


pytest.importorskip("trace_hf.kernels.sampling")

SCRIPT = textwrap.dedent(
    """
    import copy, os
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import GenerationConfig
    from trace_hf import TraceFP4Config
    from trace_hf import testing as T
    from trace_hf.quant.quantizer import quantize_model
    from trace_hf.rollout import EngineRollout
    from trace_hf.rollout.engine.weights import ShardedWeights

    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = T.tiny_model(num_hidden_layers=2)
    quantize_model(model, TraceFP4Config(hint_layers=2))
    model.eval()
    sharded = copy.deepcopy(model)
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    sharded.eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 3, 7)]
    gc = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=[1], pad_token_id=0)
    eng = EngineRollout()
    seen = []
    for edit in (False, True):
        if edit:  # an update of the shards (no optimizer): the next rollout's gather sees it
            with torch.no_grad():
                model.lm_head.weight.mul_(-1.0)
                sharded.reshard()  # the root stays unsharded after a forward: edit the shard itself
                sharded.lm_head.weight.to_local().mul_(-1.0)
        want = EngineRollout()(model, prompts, gc, record=True)
        got = eng(sharded, prompts, gc, record=True)
        assert isinstance(eng._weights, ShardedWeights)
        assert got.completion_ids == want.completion_ids, (edit, got.completion_ids, want.completion_ids)
        assert torch.equal(got.hints.mantissa_bits, want.hints.mantissa_bits)
        seen.append(got.completion_ids)
    assert seen[0] != seen[1]  # the edit did change the rollout
    dist.destroy_process_group()
    print("OK")
    """
)


def _free_port() -> int:
    """A port nothing listens on now (a fixed one fails the test whenever another process holds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_engine_rolls_out_as_the_unsharded_model(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
