# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The rollout-decode and train-step benchmarks run end to end in their --smoke mode (CPU, tiny shapes), and the
harness they share (`benchmarks.harness`) changes kernel settings only inside its block."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import harness
from benchmarks.kernels import hopper_ab, ncu_summary


ROOT = Path(__file__).resolve().parents[2]


def _run(module: str, out: Path, runner: tuple[str, ...] = ()) -> tuple[dict, str]:
    """``python -m module --smoke`` from another directory (behind ``runner``, a wrapper module and its arguments):
    the benchmark's JSON and stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", *runner, module, "--smoke", "--out", str(out)],
        cwd=str(out.parent), env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU mode")
def test_rollout_decode_smoke(tmp_path):
    res, _ = _run("benchmarks.rollout.rollout_decode", tmp_path / "rollout.json")
    cells = {(c["setup"], c["batch"]): c for c in res["cells"]}
    for setup in ("hf", "fast_bf16", "fast_fp4"):
        for b in (1, 2):
            assert cells[(setup, b)]["status"] == "ok", cells[(setup, b)]
    fp4 = cells[("fast_fp4", 2)]
    assert "hint_overhead" in fp4 and fp4["bytes"]["experts"] < cells[("fast_bf16", 2)]["bytes"]["experts"]
    assert len(res["table"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU mode")
def test_train_step_smoke(tmp_path):
    res, _ = _run("benchmarks.training.train_step", tmp_path / "train.json")
    assert res["ratio"] > 0 and res["bf16_step_s"] > 0 and res["qat_step_s"] > 0 and res["qat_uncached_step_s"] > 0
    assert res["weight_cache_gib"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU mode")
def test_block_t_runner_sets_the_table_and_runs_the_script(tmp_path):
    """`benchmarks.kernels.with_hopper_block_t` (the 16-token-block experiment of docs/lab-notes.md 2d) from another
    directory: the table it runs with, and the wrapped benchmark's result."""
    runner = ("benchmarks.kernels.with_hopper_block_t", "16")
    res, stdout = _run("benchmarks.training.train_step", tmp_path / "train.json", runner)
    table = next(line for line in stdout.splitlines() if line.startswith("HOPPER:"))
    assert "'block_t': 16" in table and "'block_t': 8" in table  # batch 1's entry keeps its 8-token blocks
    assert res["qat_step_s"] > 0


def test_ncu_summary_reads_units_and_stalls(tmp_path):
    """`benchmarks.kernels.ncu_summary` on an ncu ``--page raw --csv`` export: durations and bytes are converted from
    the units ncu chose (us, Mbyte), and the stall reasons come out largest first."""
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    cols = {
        "Kernel Name": ("", "gate_up_kernel(int, int)"),
        "gpu__time_duration.sum": ("us", "96.384"),
        "dram__bytes_read.sum": ("Mbyte", "225.05"),
        "smsp__inst_executed.sum": ("inst", "45,944,256"),
        stall.format("long_scoreboard"): ("", "0.93"),
        stall.format("wait"): ("", "0.59"),
        stall.format("selected"): ("", "1"),
    }
    path = tmp_path / "k.raw.csv"
    path.write_text(
        "\n".join(",".join(f'"{v}"' for v in row) for row in zip(*[(k, u, v) for k, (u, v) in cols.items()])) + "\n"
    )
    (rec,) = ncu_summary.summarize(str(path))
    assert rec["kernel"] == "gate_up_kernel" and rec["us"] == pytest.approx(96.384)
    assert rec["dram_mb"] == pytest.approx(225.05) and rec["warp_inst_m"] == pytest.approx(45.944, abs=1e-3)
    assert list(rec["stalls"]) == ["selected", "long_scoreboard", "wait"]


def test_hopper_ab_patches_name_what_they_change():
    """`benchmarks.kernels.hopper_ab`'s patches: slot limits of `HOPPER`, and settings dicts of the kernel modules
    merged key by key; a key that names nothing is an error, not a variant that silently measures the base."""
    table = [(8, {"block_t": 8, "split_k": 4}), (256, {"block_t": 8})]
    got = hopper_ab.patched(table, {"*": {"block_t": 16}, "8": {"split_k": 2}, "fp4_quant.CONFIG": {}})
    assert got == [(8, {"block_t": 16, "split_k": 2}), (256, {"block_t": 16})]
    with pytest.raises(SystemExit, match="slot limits"):
        hopper_ab.patched(table, {"16": {"block_t": 16}})
    base = {"fp4": {"block_t": 128}, "hopper": {"block_t": 64, "target_programs": 1056}, "ptx": True}
    assert hopper_ab.merged(base, {"hopper": {"target_programs": 1584}, "ptx": False}) == {
        "fp4": {"block_t": 128}, "hopper": {"block_t": 64, "target_programs": 1584}, "ptx": False,
    }  # fmt: skip
    with pytest.raises(SystemExit, match="do not have"):
        hopper_ab.merged(base, {"hopper": {"target_program": 1584}})
    with pytest.raises(SystemExit, match="no settings dict"):
        hopper_ab.settings_dicts({"v": {"fp4_moe_configs.NOT_A_SETTING": {}}})
    (mod, attr, saved) = hopper_ab.settings_dicts({"v": {"fp4_moe_configs.HIDDEN_LAUNCH": {"rows": 2}}})[
        "fp4_moe_configs.HIDDEN_LAUNCH"
    ]
    assert saved == mod.HIDDEN_LAUNCH and saved is not mod.HIDDEN_LAUNCH
    dicts = hopper_ab.settings_dicts({"v": {"fp4_moe_configs.HIDDEN_LAUNCH": {"rows": 2}}})
    launch = mod.HIDDEN_LAUNCH
    try:
        hopper_ab.apply(dicts, {"fp4_moe_configs.HIDDEN_LAUNCH": {"rows": 2}})
        assert launch == {**saved, "rows": 2}  # in place: the kernels read the module's dict
    finally:
        hopper_ab.apply(dicts, {})
    assert launch == saved


def test_override_changes_kernel_settings_in_place_and_restores_them():
    """`harness.override`: a dict setting gets the given entries (in place: the kernel modules import it by name),
    a list is replaced in place, a scalar is rebound; all are back after the block, also when it raises."""
    from trace_hf.kernels import fp4_moe, fp4_moe_configs, pdl

    config, hopper, enabled = fp4_moe_configs.CONFIG, fp4_moe_configs.HOPPER, pdl.ENABLED
    saved_config, saved_hopper = {**config}, list(hopper)
    table = [(1 << 62, {"block_t": 16})]
    settings = {"fp4_moe_configs.CONFIG": {"block_m": 32}, "fp4_moe_configs.HOPPER": table, "pdl.ENABLED": not enabled}
    with pytest.raises(RuntimeError, match="inside"), harness.override(settings):
        assert fp4_moe.CONFIG is config and config["block_m"] == 32  # the kernels' own reference sees it
        assert config["dense"] is saved_config["dense"]  # entries not named stay as they are
        assert fp4_moe_configs.HOPPER is hopper and hopper == table
        assert pdl.ENABLED is (not enabled)
        raise RuntimeError("inside")
    assert fp4_moe_configs.CONFIG is config and config == saved_config
    assert fp4_moe_configs.HOPPER is hopper and hopper == saved_hopper and pdl.ENABLED is enabled


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"decode_ops.GEMV": {"block_n": 8}, "fp4_attention.CONFIG": {"target_program": 1}}, "no entries"),
        ({"fp4_moe_configs.NOT_A_SETTING": 1}, "has no setting"),
        ({"not_a_module.CONFIG": {}}, "no module"),
        ({"decode_ops.GEMV": 4}, "is a dict"),
    ],
)
def test_override_names_what_does_not_exist(settings, message):
    """A setting or an entry that is not there is an error that says so (a typo must not measure the base), and
    whatever the block had already changed is restored."""
    from trace_hf.kernels import decode_ops

    saved = dict(decode_ops.GEMV)
    with pytest.raises(ValueError, match=message), harness.override(settings):
        pass
    assert saved == decode_ops.GEMV


def test_time_per_call_and_write_json(tmp_path):
    """`time_per_call` calls ``fn`` warm-up plus timed times and returns seconds per call; `write_json` makes the
    folder and writes what JSON does not know as text."""
    calls = []
    t = harness.time_per_call(lambda: calls.append(1), 5, warmup=2)
    assert len(calls) == 7 and 0 <= t < 1
    harness.write_json(str(tmp_path / "a" / "b.json"), {"x": 1, "path": tmp_path})
    assert json.loads((tmp_path / "a" / "b.json").read_text()) == {"x": 1, "path": str(tmp_path)}


def test_call_times_times_each_call_on_its_own():
    """`call_times` makes the warm-up calls, then times each of ``n`` calls alone: a slow call shows in its own
    entry only (what the medians of the training benchmarks rely on), on the wall clock with ``wall`` or
    ``cuda=False`` too."""
    calls = []

    def fn():
        calls.append(1)
        if len(calls) == 4:
            time.sleep(0.05)

    for kw in ({}, {"cuda": False}, {"wall": True}):
        calls.clear()
        ts = harness.call_times(fn, 4, warmup=2, **kw)
        assert len(calls) == 6 and len(ts) == 4
        assert ts[1] >= 0.05 and max(ts[0], ts[2], ts[3]) < 0.05


def test_grpo_step_builds_each_setup_with_the_given_model_builder(tmp_path):
    """`grpo_step.main(build_model=...)` (how `grpo_step_qwen35` swaps the model family) calls that builder for
    every setup; here it refuses, and each setup records the refusal instead of building the Qwen3-MoE model."""
    from benchmarks.training import grpo_step

    seen = []

    def refuse(args, fp4, dev):
        seen.append(fp4)
        raise RuntimeError("builder called")

    threads = torch.get_num_threads()
    try:
        rc = grpo_step.main(["--smoke", "--setups", "engine_bf16,engine_fp4", "--out", str(tmp_path / "g.json")],
                            build_model=refuse)  # fmt: skip
    finally:
        torch.set_num_threads(threads)  # the benchmark sets one thread on the CPU
    results = json.loads((tmp_path / "g.json").read_text())["results"]
    assert rc == 1 and seen == [False, True]
    assert [r["error"] for r in results] == ["RuntimeError: builder called"] * 2


def test_grpo_step_rollout_only_times_rollouts_and_trains_nothing(tmp_path, monkeypatch):
    """`grpo_step --rollout-only` rolls out ``--steps`` generation batches through the trainer's rollout seam, one
    batch of ``prompts x num_generations`` rows each, and never enters training."""
    from benchmarks.training import grpo_step
    from trace_hf import TraceGRPOTrainer

    def no_training(self, *a, **k):
        raise AssertionError("--rollout-only trained")

    monkeypatch.setattr(TraceGRPOTrainer, "train", no_training)
    threads = torch.get_num_threads()
    try:
        rc = grpo_step.main(["--smoke", "--rollout-only", "--setups", "generate_bf16,engine_bf16",
                             "--out", str(tmp_path / "r.json")])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    out = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0, out["results"]
    for r in out["results"]:
        assert r["rollout_only"] and r["step_s"] is None and len(r["rollout_s_all"]) == 2
        assert all(0 < t <= r["rows"] * out["args"]["completion"] for t in r["rollout_tokens_all"])
    engine = out["results"][1]["engine_last_rollout"]
    assert engine["rows"] == out["results"][1]["rows"] == 8
    assert "rollout_speedup" in out["table"][1] and "step_speedup" not in out["table"][1]
    with pytest.raises(SystemExit):  # nothing to profile: refused, not ignored
        grpo_step.parse_args(["--out", "x.json", "--rollout-only", "--profile"])


def test_calibrate_eos_reaches_the_mean_or_says_it_cannot(capsys):
    """`grpo_step.calibrate_eos` sets lm_head's EOS row to ``a * u`` with the scale it returns; a mean it can reach
    stays quiet, one it cannot (rows whose hidden state points away from u never stop) prints what it got instead."""
    from benchmarks.training import grpo_step
    from trace_hf.testing import tiny_model

    torch.manual_seed(0)
    model = tiny_model()
    eos = model.config.eos_token_id
    prompts = [[int(t) for t in torch.randint(3, model.config.vocab_size, (12,))] for _ in range(8)]
    a = grpo_step.calibrate_eos(model, prompts, eos, mean_len=32, max_len=64)
    assert 0 < a < 1e3
    assert torch.allclose(model.lm_head.weight[eos].float().norm(), torch.tensor(a), rtol=1e-3)
    assert "calibrate_eos" not in capsys.readouterr().out
    grpo_step.calibrate_eos(model, prompts, eos, mean_len=2, max_len=64)
    assert "not --eos-mean 2" in capsys.readouterr().out


def test_host_profile_counts_syncs_launches_and_ops():
    """`HostProfile`'s summary of one call: device time from the kernels, each counted once (an op's self device
    time is its kernels' again), the host's syncs, launches and aten ops, and its costliest ops."""
    from types import SimpleNamespace as E

    from torch.autograd import DeviceType

    from benchmarks.training import grpo_step as g

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    ev = [
        E(key="gemm_kernel", count=10, self_cpu_time_total=0, self_device_time_total=3000, device_type=cuda),
        E(
            key="aten::_local_scalar_dense",
            count=7,
            self_cpu_time_total=500,
            self_device_time_total=0,
            device_type=cpu,
        ),
        E(key="aten::mm", count=10, self_cpu_time_total=300, self_device_time_total=3000, device_type=cpu),
        E(key="cudaLaunchKernel", count=40, self_cpu_time_total=200, self_device_time_total=0, device_type=cpu),
    ]
    host = g.HostProfile(cuda=True)
    out = host.summarize(ev, wall_s=0.012)
    assert out["wall_ms"] == 12.0 and out["device_ms"] == 3.0 and out["gpu_busy"] == 0.25
    assert out["syncs"] == {"aten::_local_scalar_dense": 7}
    assert out["launches"] == 40 and out["aten_ops"] == 17
    assert out["top_cpu_ops"][0] == ("aten::_local_scalar_dense", 0.5, 7)
    assert out["top_kernels"] == [("gemm_kernel", 3.0, 1.0)]


def test_phase_timer_keeps_each_call_and_its_tokens():
    """`PhaseTimer` sums a phase's calls into the step's phase time and keeps every call in order: its seconds and,
    with ``mask_arg``, the real tokens of the attention mask it was given (positionally or by keyword)."""
    from types import SimpleNamespace as E

    from benchmarks.training import grpo_step as g

    timer = g.PhaseTimer(cuda=False)
    obj = E(fwd=lambda model, ids, attention_mask, n: time.sleep(0.01 * n), bwd=lambda: time.sleep(0.002))
    timer.wrap(obj, "fwd", "train_forward", mask_arg=2)
    timer.wrap(obj, "bwd", "backward")
    timer.callback.on_step_begin(None, None, None)
    obj.fwd(None, None, torch.tensor([[1, 1, 0], [1, 0, 0]]), 1)
    obj.bwd()
    obj.fwd(None, None, attention_mask=torch.ones(4, 5), n=3)
    timer.callback.on_step_end(None, None, None)
    calls = timer.calls[-1]
    assert [c[1] for c in calls["train_forward"]] == [3, 20] and [len(c) for c in calls["backward"]] == [1]
    assert calls["train_forward"][1][0] > calls["train_forward"][0][0] >= 0.01
    assert timer.steps[-1]["train_forward"] == pytest.approx(sum(c[0] for c in calls["train_forward"]), abs=2e-3)


def test_phase_timer_counts_triton_compiles_by_phase():
    """Each Triton cache miss (the hook Triton calls before compiling) counts under the innermost running phase, or
    "other"; a hook installed before still runs, and each step keeps its own counts."""
    from types import SimpleNamespace as E

    from benchmarks.training import grpo_step as g

    knobs = pytest.importorskip("triton.knobs", reason="triton.knobs (Triton 3.4+)").runtime
    seen, before = [], knobs.jit_cache_hook
    knobs.jit_cache_hook = lambda *a, **k: seen.append(k["fn"]) or False
    try:
        timer = g.PhaseTimer(cuda=False)
        timer._count_compiles()
        miss = lambda name: knobs.jit_cache_hook(fn=name)  # noqa: E731
        obj = E(roll=lambda: (miss("a"), obj.compact()), compact=lambda: miss("b"), fwd=lambda: miss("c"))
        timer.watch_peak(obj, "roll", "rollout")
        timer.wrap(obj, "compact", "rollout_compaction")
        timer.wrap(obj, "fwd", "train_forward")
        for _ in range(2):
            timer.callback.on_step_begin(None, None, None)
            obj.roll()
            obj.fwd()
            obj.fwd()
            miss("d")
            timer.callback.on_step_end(None, None, None)
        assert knobs.jit_cache_hook(fn="e") is False  # compile goes on
    finally:
        knobs.jit_cache_hook = before
    assert timer.compiles == [{"rollout": 1, "rollout_compaction": 1, "train_forward": 2, "other": 1}] * 2
    assert seen == ["a", "b", "c", "c", "d"] * 2 + ["e"]


def test_stall_log_runs_the_module_it_wraps_with_its_arguments():
    """`benchmarks.stall_log` hands the rest of the command line to the benchmark it runs; without one it says how."""
    import subprocess
    import sys

    run = lambda *a: subprocess.run([sys.executable, "-m", "benchmarks.stall_log", *a], capture_output=True, text=True)  # noqa: E731
    wrapped = run("benchmarks.training.grpo_step", "--help")
    assert wrapped.returncode == 0 and "usage: grpo_step.py" in wrapped.stdout and "--profile-host" in wrapped.stdout
    bare = run()
    assert bare.returncode == 2 and "python -m benchmarks.stall_log benchmarks.training.grpo_step" in bare.stderr


def test_grpo_step_profile_flags_exclude_each_other():
    from benchmarks.training import grpo_step as g

    with pytest.raises(SystemExit):
        g.parse_args(["--out", "x.json", "--profile", "--profile-host"])


def test_last_step_profile_of_the_rollout_only():
    """`--profile rollout`: `LastStepProfile` profiles the watched call (the trainer's rollout) in the last step only,
    its first call there, and reports its ops and their total; earlier steps' calls and the rest of the step are not
    in it."""
    from types import SimpleNamespace as S

    from benchmarks.training import grpo_step as g

    class Trainer:
        def roll(self, n):
            return torch.ones(n, n) @ torch.ones(n, n)

    prof, t = g.LastStepProfile(cuda=False, scope="rollout"), Trainer()
    prof.watch(t, "roll")
    for step in range(2):
        state = S(global_step=step, max_steps=2)
        prof.callback.on_step_begin(None, state, None)
        t.roll(64)
        if step == 0:
            assert prof.kernels == []
        else:
            first = list(prof.kernels)
            torch.ones(8).sum()  # the rest of the step: not profiled
            t.roll(32)  # a second call: not profiled either
        prof.callback.on_step_end(None, state, None)
    names = [k for k, _, _ in first]
    assert "aten::mm" in names and "aten::sum" not in names and prof.kernels == first
    assert prof.total_ms >= sum(ms for _, ms, _ in first) - 0.05


def test_last_step_profile_of_the_training_side_only():
    """`--profile train`: the profile starts when the last step's rollout returns and stops at the step's end, so
    the rollout's ops are not in it and the training side's are."""
    from types import SimpleNamespace as S

    from benchmarks.training import grpo_step as g

    class Trainer:
        def roll(self, n):
            return torch.ones(n, n) @ torch.ones(n, n)

    prof, t = g.LastStepProfile(cuda=False, scope="train"), Trainer()
    prof.watch(t, "roll")
    for step in range(2):
        state = S(global_step=step, max_steps=2)
        prof.callback.on_step_begin(None, state, None)
        t.roll(64)
        torch.ones(8).sum()  # the training side
        prof.callback.on_step_end(None, state, None)
    names = [k for k, _, _ in prof.kernels]
    assert "aten::sum" in names and "aten::mm" not in names


def test_kernel_classes_sort_the_glue_from_the_gemms():
    """`kernel_class`: trace-hf's own kernels by name, then attention, GEMMs, copies and gathers, elementwise,
    reductions; `kernel_classes` sums device ms by class."""
    from types import SimpleNamespace as E

    from benchmarks.training import grpo_step as g

    ours = frozenset({"_fp4_kernel", "gate_up_kernel", "_grouped_gemm_kernel"})
    cases = {
        "_fp4_kernel": "trace-hf kernels",
        "_grouped_gemm_kernel": "trace-hf kernels",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd>(Flash_bwd_params)": "attention",
        "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT": "gemm",
        "void at::native::vectorized_gather_kernel<16, long>(char*, char*)": "copy/gather/scatter",
        "void at::native::index_elementwise_kernel<128, 4>(long, at::native::gpu_index_kernel)": "copy/gather/scatter",
        "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>(int)": "elementwise",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>(at::native::ReduceOp<float>)": "reduce/sort/scan",
        "something_else": "other",
    }  # fmt: skip
    assert {n: g.kernel_class(n, ours) for n in cases} == cases
    ev = [E(key="_fp4_kernel", self_device_time_total=2000), E(key="nvjet_x", self_device_time_total=5000),
          E(key="aten::mm", self_device_time_total=0)]  # fmt: skip
    assert g.kernel_classes(ev) == {"gemm": 5.0, "trace-hf kernels": 2.0}
