# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Two CPU processes (torchrun, gloo): TraceGRPOTrainer under DDP, and the FP4 model under FSDP2."""

from __future__ import annotations

import json
import os
import subprocess
import sys


HERE = os.path.dirname(os.path.abspath(__file__))


def run_two_processes(script: str, out_dir) -> None:
    """torchrun with 2 processes. Not `accelerate launch --num_processes 2 --cpu`: without an accelerate config that
    starts a single process (its multi-CPU path goes through MPI); with torchrun's env vars Accelerate picks
    MULTI_CPU/gloo. The cwd is outside the repository: `python -m` puts the cwd on sys.path, and the repo root holds
    a folder `kernels/`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [*cmd, os.path.join(HERE, script), str(out_dir)],
        cwd=out_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]


def test_two_process_cpu_run(tmp_path):
    run_two_processes("distributed_grpo.py", tmp_path)
    with open(tmp_path / "log_history.json") as f:
        logged = json.load(f)
    assert logged["num_processes"] == 2
    # The packed FP4 rollout weights follow the updated master weights on every rank.
    assert logged["packed_matches_full_masters"]
    steps = [h for h in logged["history"] if "reward" in h]
    assert len(steps) == 2
    for key in (
        "sampling/sampling_logp_difference/mean",
        "trace/hint_flip_rate",
        "trace/routing_mismatch",
        "sampling/importance_sampling_ratio/mean",
    ):
        assert all(key in h and h[key] == h[key] for h in steps), key
    assert all(h["trace/train/hint_flip_rate"] < 0.2 for h in steps)


def test_fsdp2_sharded_masters_two_cpu_processes(tmp_path):
    """FSDP2 (`fully_shard`, gloo): hints recorded and applied with sharded masters; packed rollout weights are
    built from the gathered layer and equal the quantization of the full masters after an optimizer step; the rollout
    engine gathers the sharded weights itself and rolls out what generate does."""
    run_two_processes("distributed_fsdp2.py", tmp_path)
    for rank in (0, 1):
        with open(tmp_path / f"fsdp2-{rank}.json") as f:
            r = json.load(f)
        assert r["sharded"] and r["packed_matches_full_masters"], r
        assert r["loss"] == r["loss"]  # finite
        # The rollout engine on sharded masters: same tokens as generate, the same hints to fp32 summation order.
        assert r["engine_matches_generate"] and r["engine_hint_bits_agree"] > 0.999, r
