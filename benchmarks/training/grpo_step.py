# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Whole GRPO steps of `TraceGRPOTrainer` on a random Qwen3-30B-A3B-shaped model: what the rollout engine buys.

    python -m benchmarks.training.grpo_step --out outputs/grpo_step.json              # H200, 8 layers, a few minutes
    python -m benchmarks.training.grpo_step --smoke --out /tmp/grpo_step_smoke.json   # CPU, tiny model, interpreter
    torchrun --nproc_per_node 2 -m benchmarks.training.grpo_step --setups engine_fp4 --out ...  # DDP, 64 rows per GPU
    accelerate launch --config_file examples/accelerate/fsdp2.yaml -m benchmarks.training.grpo_step \
        --setups engine_fp4 --layers 28 --out ...                                     # FSDP2 over the GPUs

Setups (the same random weights, prompts and TRL settings; one rollout and one optimizer step per GRPO step):
  ``generate_bf16``  the plain model, `model.generate` (what a TRL user gets without vLLM);
  ``engine_bf16``    the plain model, the rollout engine with a BF16 KV cache (the fair baseline);
  ``engine_fp4``     `TraceFP4Config` (W4A4 experts, FP4 KV cache), the engine, hints + routing replay (TRACE).
Full size on one GPU (the 48-layer Qwen3-30B-A3B shape): ``--layers 48 --freeze-experts --lora-r 32`` freezes the
routed experts (FP4 setups: packed FP4, `TraceFP4Config(freeze_experts=True)`; BF16 setups: BF16 experts without
gradients) and trains PEFT LoRA on q/k/v/o. The model is built on the meta device and filled one layer at a time
(random BF16 experts drawn per layer from a seeded generator, then quantized), so all BF16 experts never exist at
once in the FP4 setups. ``--eos-mean N`` gives completions a long-tailed length spread: the EOS row of lm_head is set
to ``a * u`` (``u`` a fixed random direction), with ``a`` chosen on a calibration prefill of 32 prompts so that the
expected completion length is N (`calibrate_eos`). Each row then stops at its own rate (the random model's hidden
state keeps a component of its prompt, so rates differ between rows far more than along a row): lengths are a
mixture of geometric distributions, truncated at ``--completion``. The
spread of the last rollout (length quantiles, min, max) and what it cost the engine (waves, bucket rows, decode
steps per wave, row-steps decoded and those that decoded padding, compactions and each wave's bucket trajectory,
slot occupancy: kept tokens over the row-steps decoded, rows prefilled) are in ``engine_last_rollout``;
``--no-compaction`` turns the engine's live-row compaction off (`EngineRollout(compaction=False)`: each wave decodes
in its bucket to the end), ``--no-share-prefill`` its prefill of each distinct prompt once (`EngineRollout(
share_prefill=False)`: all ``num_generations`` copies of a prompt are prefilled).
``--wave-rows`` caps the engine's rows per wave (`EngineRollout(max_rows=...)`); without it the engine admits as
many rows as fit in free memory and runs the rest in equal waves (the BF16 KV cache of 256 x 1K rows of the full
model does not fit beside its weights; FP4's does). Every setup also reports a per-phase profile of the last step (``phases_last_step``; each call of each phase, its
seconds and the training-side forwards' real tokens, in ``phase_calls_last_step``), and every finished step prints a
``STEP {...}`` line (seconds, phases, peak memory so far and each phase's own, ``phase_peak_gib``, the Triton kernels
each phase compiled, ``triton_compiles``, the engine's last rollout), for runs that their time limit cuts short. Read
timings from steps whose ``triton_compiles`` is empty.

    python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --eos-mean 384 \
        --setups engine_fp4,engine_bf16,generate_bf16 --wave-rows 128 --out outputs/grpo_30b_1k.json   # 256 x 1K
    python -m benchmarks.training.grpo_step --layers 48 --freeze-experts --lora-r 32 --prompts 8 --completion 8192 \
        --eos-mean 3072 --micro-batch 1 --wave-rows 16 --setups engine_fp4,engine_bf16 --out ...        # 64 x 8K

Batch: ``--prompts`` x ``--num-generations`` rows of ``--prompt-len`` random tokens, completions of
``--completion`` tokens (without ``--eos-mean``, EOS is a token the random model almost never draws, so they run to
length). Reported
per setup: rollout seconds and tokens/s, whole-step seconds (steps after the first, which compiles and captures),
peak memory (per GPU), and the ratios to ``generate_bf16``; with ``--profile`` also the last step's device time
by kernel (``kernels_last_step``: what a rollout spends in prefill, decode and re-packing, and training in what;
``--profile rollout``: the last step's rollout alone, ``kernels_last_rollout``, and each profile's device total); with
``--profile-host`` instead, one call of each training phase with the host's side (``host_profile_last_step``). Under several processes every GPU rolls out its own
64 rows; tokens/s are per GPU and in all (``*_total``), and the main process writes the JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time

from benchmarks import harness


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (the Triton interpreter)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--setups", default="generate_bf16,engine_bf16,engine_fp4")
    p.add_argument("--profile", nargs="?", const="step", choices=["step", "rollout", "train"], default=None,
                   help="break the last step's device time down by kernel and kernel class; `--profile rollout`: only "
                        "its rollout (the engine's or generate's), to compare the precisions' rollouts kernel by kernel; "
                        "`--profile train`: only its training side (scoring forwards, training forwards, backward)")  # fmt: skip
    p.add_argument("--profile-host", action="store_true",
                   help="profile one call of each training phase in the last step, host side included")  # fmt: skip
    p.add_argument(
        "--freeze-experts",
        action="store_true",
        help="frozen routed experts: packed FP4 (TraceFP4Config(freeze_experts=True)) or BF16 without grad",
    )
    p.add_argument(
        "--prefill-bf16-gemms",
        action="store_true",
        help="FP4 setups: TraceFP4Config(prefill_bf16_gemms=True), the prefill's experts as bf16 grouped GEMMs",
    )
    p.add_argument(
        "--lora-r",
        type=int,
        default=0,
        help="PEFT LoRA rank on every projection the engine folds for the family (0: full fine-tune)",
    )
    p.add_argument(
        "--eos-mean", type=int, default=0, help="mean completion length via a calibrated EOS logit (0: off)"
    )
    p.add_argument(
        "--micro-batch", type=int, default=8, help="rows per training forward (per_device_train_batch_size)"
    )
    p.add_argument("--wave-rows", type=int, default=0,
                   help="engine rollouts in waves of at most this many rows (EngineRollout(max_rows=...); 0: as "
                        "many as fit in free memory, the engine's own admission)")  # fmt: skip
    p.add_argument("--no-compaction", action="store_true",
                   help="engine rollouts without live-row compaction (EngineRollout(compaction=False))")  # fmt: skip
    p.add_argument("--coarse-buckets", action="store_true",
                   help="engine row buckets of 64 past 64 rows (runner.BUCKETS_PER_OCTAVE=1): the before of a quarter "
                        "octave's step (16 up to 128 rows, 32 up to 256), which lets a tail of ~150 rows decode in 160")  # fmt: skip
    p.add_argument("--no-share-prefill", action="store_true",
                   help="engine rollouts prefill every row, not each distinct prompt once "
                        "(EngineRollout(share_prefill=False))")  # fmt: skip
    p.add_argument("--rollout-only", action="store_true",
                   help="time each setup's rollout alone, --steps times over fresh prompts, through the trainer's own "
                        "rollout seam (no training side): `generate` at full depth, where a whole step costs minutes")  # fmt: skip
    p.add_argument("--learning-rate", type=float, default=None, help="default: 1e-6, or 1e-5 with LoRA")
    p.add_argument("--group-by-length", action="store_true",
                   help="micro-batches of rows of similar length (train_sampling_strategy='group_by_length')")  # fmt: skip
    p.add_argument("--token-budget", type=int, default=None,
                   help="TraceGRPOConfig.token_budget: padding-free packed training-side forwards (default None: packed "
                        "where exact, i.e. Qwen3 MoE; 0: TRL's padded micro-batches)")  # fmt: skip
    p.add_argument("--gated-delta-rule", choices=["auto", "chunk", "recurrent"], default="auto",
                   help="TraceGRPOConfig.gated_delta_rule (Gated DeltaNet models: grpo_step_qwen35): the training "
                        "forwards' rule (auto: recurrent on those models)")  # fmt: skip
    harness.add_kernel_flags(p)
    p.add_argument("--scoring-forward", action="store_true",
                   help="TraceGRPOConfig(skip_scoring_forward=False): a no-grad scoring forward over each generation "
                        "batch for the IS ratio and the trace/* metrics, the before of taking them from the training "
                        "forwards")  # fmt: skip
    p.add_argument("--recompute-experts", action="store_true",
                   help="frozen FP4 experts recomputed in the checkpointed backward even where they end their MoE block "
                        "(TraceFP4Experts.last_in_block=False): the before of keeping their saved tensors")  # fmt: skip
    p.add_argument("--recurrent-chunk-gradient", action="store_true",
                   help="gated_delta_rule='recurrent' with the chunked form's gradient straight through "
                        "(delta_rule.KERNEL_GRADIENT=False): the before of the recurrent rule's backward kernel")  # fmt: skip
    p.add_argument("--rule-over-padding", action="store_true",
                   help="the recurrent rule's kernel steps packed rows' right padding too "
                        "(delta_rule.SKIP_ROW_PADDING=False): the before of stepping each row's own tokens only")  # fmt: skip
    args = p.parse_args(argv)
    if args.profile and args.profile_host:
        p.error("--profile and --profile-host each run torch.profiler in the last step; pass one of them per run")
    if args.rollout_only and (args.profile or args.profile_host):
        p.error("--rollout-only runs no optimizer step for --profile / --profile-host to profile; drop one of them")
    return args


def word_tokenizer(vocab: int):
    """A tokenizer with one word per id (``<i>``), so any sampled id decodes; no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<3>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<0>", eos_token="<1>", bos_token="<2>",
                                   unk_token="<3>", padding_side="left")  # fmt: skip


def build_model(args, fp4: bool, dev):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from trace_hf import TraceFP4Config
    from trace_hf.quant.quantizer import quantize_model

    if args.smoke:
        shape = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                 "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "vocab_size": 300,
                 "intermediate_size": 64}  # fmt: skip
    else:
        shape = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "vocab_size": 151936,
                 "intermediate_size": 6144}  # fmt: skip
    cfg = Qwen3MoeConfig(num_hidden_layers=args.layers, max_position_embeddings=32768, tie_word_embeddings=False,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2, **shape)  # fmt: skip
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    opt_in = getattr(args, "prefill_bf16_gemms", False)
    if args.freeze_experts:
        return build_frozen(cfg, fp4, dev, dtype, opt_in)
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if fp4:
        # Under FSDP2 the QAT weight cache would hold every layer's full dequantized experts on every GPU.
        fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        quantize_model(model, TraceFP4Config(cache_qat_weights=not fsdp, prefill_bf16_gemms=opt_in))
    return model


def build_frozen(cfg, fp4: bool, dev, dtype, prefill_bf16_gemms: bool = False):
    """Meta skeleton, then every weight materialized on `dev`: non-expert ones by the model's own initializer, the
    experts one layer at a time from a per-layer seeded generator (the same draws for FP4 and BF16), quantized into
    the frozen FP4 buffers as each layer is drawn. BF16 experts are frozen (no gradient)."""
    import torch
    from transformers import AutoModelForCausalLM

    from trace_hf import TraceFP4Config
    from trace_hf.quant.experts import TraceFP4Experts
    from trace_hf.quant.quantizer import quantize_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if fp4:
        quantize_model(model, TraceFP4Config(freeze_experts=True, prefill_bf16_gemms=prefill_bf16_gemms))
    model.to_empty(device=dev)
    with torch.no_grad():
        for mod in model.modules():
            if not hasattr(mod, "gate_up_proj"):
                model._init_weights(mod)
        std = cfg.initializer_range
        E, H, W = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        for i, layer in enumerate(model.model.layers):
            gen = torch.Generator(device=dev).manual_seed(1000 + i)
            gu = torch.empty(E, 2 * W, H, dtype=dtype, device=dev).normal_(0, std, generator=gen)
            d = torch.empty(E, H, W, dtype=dtype, device=dev).normal_(0, std, generator=gen)
            ex = layer.mlp.experts
            if isinstance(ex, TraceFP4Experts):
                ex.pack_from(gu, d)
            else:
                ex.gate_up_proj.copy_(gu)
                ex.down_proj.copy_(d)
                ex.requires_grad_(False)
            del gu, d
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.pad_token_id = cfg.pad_token_id
    return model


def calibrate_eos(model, prompt_ids: list[list[int]], eos: int, mean_len: int, max_len: int) -> float:
    """Set lm_head's EOS row to ``a * u`` so that the expected completion length is `mean_len`, and return ``a``.

    The EOS probability at a position is ``sigmoid(a * h.u - logsumexp(other logits))``, measured on a calibration
    prefill (one row per prompt). It varies between rows far more than along a row: a random model's hidden state
    keeps a component of its context. So each row is modelled as stopping at its own rate ``p_r`` (the mean over
    its positions), with expected length ``(1 - (1 - p_r)^max_len) / p_r``, and ``a`` is bisected until the mean
    over rows is `mean_len`. A single mean rate over all positions would let a few rows that stop at once stand for
    all of them, and most rows would then run to `max_len`."""
    import torch

    head, norm = model.lm_head.weight, model.model.norm
    kept = {}
    hook = norm.register_forward_hook(lambda m, a, out: kept.__setitem__("h", out))
    was = model.training
    model.eval()
    with torch.no_grad():
        head[eos].zero_()
        ids = torch.tensor(prompt_ids, device=head.device)
        logits = model(input_ids=ids).logits.float()
    hook.remove()
    model.train(was)
    h = kept["h"].float()  # [rows, positions, hidden]
    logits[..., eos] = -float("inf")
    lse = torch.logsumexp(logits, -1)
    u = torch.randn(head.shape[1], generator=torch.Generator().manual_seed(7)).to(h.device)
    u = u / u.norm()
    proj = h @ u

    def expected_length(a: float) -> float:
        p = torch.sigmoid(a * proj - lse).mean(1).double().clamp(min=1e-12)  # exp(z) / (exp(z) + the others)
        return ((1 - (1 - p) ** max_len) / p).mean().item()

    bound = 1e3
    lo, hi = 0.0, bound
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if expected_length(a) > mean_len else (lo, a)
    got = expected_length(a)
    if abs(got - mean_len) > 0.05 * mean_len:  # e.g. too many rows whose hidden state points away from u never stop
        print(f"calibrate_eos: the expected mean length is {got:.0f}, not --eos-mean {mean_len} (scale {a:.1f}, "
              f"bound {bound:.0f}); this setup's completions will be longer than asked", flush=True)  # fmt: skip
    with torch.no_grad():
        head[eos].copy_((a * u).to(head.dtype))
    return a


class PhaseTimer:
    """Per-phase wall time of each optimizer step (CUDA-synchronized at the phase boundaries): LoRA merge and weight
    refresh, prefill, decode (the rest of the rollout), log-prob forwards (no grad), training forwards, backward,
    optimizer. The rollout's own total is `trace/rollout/seconds`. On CUDA also each timed phase's peak memory
    (``peaks``, GiB), so that the run's peak (`peak_gib`) says which phase set it, and each step's allocator retries
    (``retries``: allocations that found no cached block and freed the cache to retry, a device-wide stall each).
    ``calls``: each step's calls of each wrapped phase in order, their seconds and (training-side forwards) the real
    tokens they fed, since one profiled call need not be a typical one. ``compiles``: each step's Triton kernels
    compiled (or loaded from disk) by phase, "other" outside the timed ones: a step that compiles is no steady-state
    measurement (a new token count can still compile a kernel in step 3, docs/lab-notes.md 33)."""

    def __init__(self, cuda: bool):
        from transformers import TrainerCallback

        self.cuda, self.now, self.steps = cuda, {}, []
        self.peak_now: dict[str, float] = {}
        self.peaks: list[dict[str, float]] = []
        self.calls_now: dict[str, list[list]] = {}
        self.calls: list[dict[str, list[list]]] = []
        self.retries: list[int] = []
        self.compiles_now: dict[str, int] = {}
        self.compiles: list[dict[str, int]] = []
        self._active: list[str] = []  # the phases running now, innermost last
        self._retries = 0  # the allocator's retry count when the step began
        self._peak = 0.0  # bytes: the peak before the last reset of the allocator's counter
        self.host: HostProfile | None = None  # --profile-host: profiles one call of each phase
        timer = self

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                timer.now, timer.peak_now, timer.calls_now, timer.compiles_now = {}, {}, {}, {}
                timer._retries = timer._alloc_retries()

            def on_pre_optimizer_step(self, args, state, control, **kw):
                timer._opt = timer._clock()
                timer._phase_begin()

            def on_optimizer_step(self, args, state, control, **kw):
                timer._add("optimizer", timer._clock() - timer._opt)
                timer._phase_end("optimizer")

            def on_step_end(self, args, state, control, **kw):
                timer.steps.append({k: round(v, 3) for k, v in timer.now.items()})
                timer.peaks.append({k: round(v, 2) for k, v in timer.peak_now.items()})
                timer.calls.append(timer.calls_now)
                timer.compiles.append(timer.compiles_now)
                timer.compiles_now = {}  # what compiles between steps belongs to neither
                timer.retries.append(timer._alloc_retries() - timer._retries)

        self.callback = _CB()
        if cuda:
            self._count_compiles()

    def _count_compiles(self) -> None:
        """Count each Triton in-memory cache miss under the running phase (Triton 3.4+; the hook before, such as
        `benchmarks.stall_log`'s, still runs)."""
        try:
            from triton import knobs
        except ImportError:
            return
        before = knobs.runtime.jit_cache_hook

        def on_miss(*args, **kwargs):
            self.on_compile()
            return before(*args, **kwargs) if before is not None else False

        knobs.runtime.jit_cache_hook = on_miss

    def on_compile(self) -> None:
        key = self._active[-1] if self._active else "other"
        self.compiles_now[key] = self.compiles_now.get(key, 0) + 1

    def peak_gib(self) -> float | None:
        """The run's peak allocated memory so far, across the per-phase resets of the allocator's counter."""
        import torch

        return max(self._peak, torch.cuda.max_memory_allocated()) / 2**30 if self.cuda else None

    def _alloc_retries(self) -> int:
        import torch

        return torch.cuda.memory_stats().get("num_alloc_retries", 0) if self.cuda else 0

    def _phase_begin(self) -> None:
        import torch

        if self.cuda:
            self._peak = max(self._peak, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    def _phase_end(self, phase: str) -> None:
        import torch

        if self.cuda:
            gib = torch.cuda.max_memory_allocated() / 2**30
            self.peak_now[phase] = max(self.peak_now.get(phase, 0.0), gib)

    def _clock(self) -> float:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _add(self, phase: str, dt: float) -> None:
        self.now[phase] = self.now.get(phase, 0.0) + dt

    def wrap(self, obj, name: str, phase, mask_arg: int | None = None) -> None:
        """Time `obj.name` under `phase` (a name, or a function of no arguments that returns one). ``mask_arg``: the
        position of its ``attention_mask`` argument, whose sum each call's record then carries."""
        orig = getattr(obj, name)

        def timed(*a, **k):
            key = phase() if callable(phase) else phase
            t0 = self._clock()
            self._phase_begin()
            self._active.append(key)
            try:
                if self.host is not None and self.host.wants(key):
                    return self.host.run(key, orig, a, k)
                return orig(*a, **k)
            finally:
                self._active.pop()
                dt = self._clock() - t0
                self._add(key, dt)
                self._phase_end(key)
                mask = k.get("attention_mask", a[mask_arg] if mask_arg is not None and len(a) > mask_arg else None)
                tokens = [int(mask.sum())] if mask is not None else []  # after the clock: its sync is not timed
                self.calls_now.setdefault(key, []).append([round(dt, 4), *tokens])

        setattr(obj, name, timed)

    def watch_peak(self, obj, name: str, phase: str) -> None:
        """Keep the peak memory of `obj.name` under `phase`, untimed (the rollout, whose parts are timed inside)."""
        orig = getattr(obj, name)

        def watched(*a, **k):
            self._phase_begin()
            self._active.append(phase)
            try:
                return orig(*a, **k)
            finally:
                self._active.pop()
                self._phase_end(phase)

        setattr(obj, name, watched)

    def watch_engine(self, engine) -> None:
        """Refresh (packed experts, fused QKV, LoRA merge), prefill and live-row compactions of an `EngineRollout`."""
        self.wrap(engine, "_weights_for", "rollout_refresh_and_lora_merge")
        self.wrap(engine, "_compact", "rollout_compaction")
        orig_runner, orig_load = engine._runner, engine._load_cache

        def runner(*a, **k):
            out = orig_runner(*a, **k)
            self._t_prefill = self._clock()
            return out

        def load(*a, **k):
            self._add("rollout_prefill", self._clock() - self._t_prefill)
            return orig_load(*a, **k)

        engine._runner, engine._load_cache = runner, load


class StepTimer:
    """A TrainerCallback that keeps the wall time of every optimizer step."""

    def __init__(self):
        from transformers import TrainerCallback

        timer = self

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                timer._t = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                import torch

                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                timer.steps.append(time.perf_counter() - timer._t)

        self.steps: list[float] = []
        self.callback = _CB()


class StepLog:
    """A TrainerCallback (after `StepTimer` and `PhaseTimer`) that prints one JSON line per optimizer step: its
    seconds, phases, the peak memory so far and the engine's last rollout (`engine_stats`), so that a run cut short
    by its time limit still shows the steps it finished (the result JSON is written only at the end)."""

    def __init__(self, name: str, steps: StepTimer, phases: PhaseTimer):
        from transformers import TrainerCallback

        self.rollout = None  # the engine, once the setup has made it (None: generate)
        log = self

        class _CB(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                line = {"setup": name, "step": state.global_step, "step_s": round(steps.steps[-1], 3),
                        "peak_gib": phases.peak_gib(), "phase_peak_gib": phases.peaks[-1], "phases": phases.steps[-1],
                        "alloc_retries": phases.retries[-1], "triton_compiles": phases.compiles[-1],
                        "engine": engine_stats(log.rollout)}  # fmt: skip
                if state.is_world_process_zero:
                    print("STEP " + json.dumps(line), flush=True)

        self.callback = _CB()


class LastStepProfile:
    """A TrainerCallback that runs torch.profiler over the last optimizer step (``scope="step"``: rollout and
    training), over that step's rollout only (``"rollout"``, through `watch`) or over what follows it (``"train"``):
    which kernels the device time goes to (on CPU, the CPU time of each op), by class (`kernel_class`), and their
    total."""

    def __init__(self, cuda: bool, scope: str = "step"):
        from transformers import TrainerCallback

        prof = self
        self.cuda, self.scope, self.armed, self._p = cuda, scope, False, None
        self.kernels: list = []
        self.classes: dict = {}
        self.total_ms: float | None = None

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                prof.armed = state.global_step == state.max_steps - 1
                if prof.armed and prof.scope == "step":
                    prof._start()

            def on_step_end(self, args, state, control, **kw):
                if prof._p is not None:
                    prof._stop()
                prof.armed = False

        self.callback = _CB()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._p = profile(activities=[ProfilerActivity.CUDA if self.cuda else ProfilerActivity.CPU])
        self._p.__enter__()

    def _stop(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        self._p.__exit__(None, None, None)
        events = self._p.key_averages()
        self.kernels = top_times(events, self.cuda, 25 if self.scope == "rollout" else 20)
        self.classes = kernel_classes(events) if self.cuda else {}
        self.total_ms = round(sum(_self_time(e, self.cuda) for e in events) / 1e3, 2)
        self._p = None

    def watch(self, obj, name: str) -> None:
        """With ``scope="rollout"``: profile the last step's first call of `obj.name` (the trainer's rollout); with
        ``"train"``: start profiling when it returns (the step's end stops it)."""
        if self.scope == "step":
            return
        orig = getattr(obj, name)

        def profiled(*a, **k):
            if not self.armed or self.kernels or self._p is not None:
                return orig(*a, **k)
            if self.scope == "train":
                out = orig(*a, **k)
                self._start()
                return out
            self._start()
            try:
                return orig(*a, **k)
            finally:
                self._stop()

        setattr(obj, name, profiled)


def _self_time(e, cuda: bool) -> float:
    return max(0.0, e.self_device_time_total if cuda else e.self_cpu_time_total)


def top_times(events, cuda: bool, n: int) -> list:
    """The ``n`` costliest kernels (on CPU: ops by self CPU time) of a profile: (name, ms, share of the total)."""
    rows = [(e.key, _self_time(e, cuda)) for e in events]
    rows = [(k, t) for k, t in rows if t > 0]
    total = sum(t for _, t in rows) or 1.0
    return [(k[:60], round(t / 1e3, 2), round(t / total, 3)) for k, t in sorted(rows, key=lambda r: -r[1])[:n]]


#: Kernel classes by name fragment, tried in order; the first that matches a kernel's name is its class.
KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attn", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "Kernel2", "splitKreduce")),
    ("copy/gather/scatter", ("gather", "scatter", "index", "copy", "CatArray", "cat_", "Memcpy", "memcpy")),
    ("elementwise", ("elementwise", "fill", "Memset")),
    ("reduce/sort/scan", ("reduce", "softmax", "norm", "sort", "scan", "Radix", "cub::", "topk")),
)


def kernel_class(name: str, ours: frozenset) -> str:
    """``"trace-hf kernels"`` for a Triton/Gluon kernel of `kernels/` (``ours``: their names), else the first class
    of `KERNEL_CLASSES` whose fragment the name holds, else ``"other"``."""
    if name.split("(")[0].split(" ")[-1] in ours:
        return "trace-hf kernels"
    return next((c for c, frags in KERNEL_CLASSES if any(f in name for f in frags)), "other")


def kernel_classes(events) -> dict:
    """Device ms by `kernel_class` over a profile's kernels: where the glue (elementwise, copies, gathers) stands
    against the GEMMs, attention and trace-hf's own kernels."""
    import pathlib
    import re

    src = pathlib.Path(__file__).resolve().parents[2] / "kernels"
    ours = frozenset(m for f in src.glob("*.py") for m in re.findall(r"^def (\w+)\(", f.read_text(), re.M))
    out: dict = {}
    for e in events:
        t = e.self_device_time_total
        if t > 0:
            c = kernel_class(e.key, ours)
            out[c] = out.get(c, 0.0) + t / 1e3
    return {c: round(ms, 1) for c, ms in sorted(out.items(), key=lambda kv: -kv[1])}


#: The runtime calls that make the host wait for the device (`.item()`, `.tolist()`, `int(t)` go through
#: `aten::_local_scalar_dense`) and those that launch work, counted by `HostProfile`.
SYNC_OPS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCH_OPS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


class HostProfile:
    """``--profile-host``: in the last step, the first call of each training phase (one micro-batch's scoring
    forward, training forward and backward) under torch.profiler with CPU activity: its wall and device time, the
    host's syncs, launches and aten ops, and where the host's time goes. A forward whose device time is far below its
    wall is bound by the Python and launches that feed it. One call each, because tracing every op of a 48-layer
    step gives millions of events that take minutes to summarize."""

    def __init__(self, cuda: bool):
        from transformers import TrainerCallback

        self.cuda, self.armed, self.phases = cuda, False, {}
        host = self

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                host.armed = state.global_step == state.max_steps - 1

        self.callback = _CB()

    def wants(self, phase: str) -> bool:
        return self.armed and phase not in self.phases

    def run(self, phase: str, fn, args, kwargs):
        import torch
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with profile(activities=acts) as p:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        self.phases[phase] = self.summarize(p.key_averages(), wall)
        return out

    def summarize(self, events, wall_s: float) -> dict:
        from torch.autograd import DeviceType

        count = {e.key: e.count for e in events}
        cpu = sorted(((e.key, e.self_cpu_time_total, e.count) for e in events), key=lambda r: -r[1])
        # With CPU activity on, an op's self device time is that of the kernels it launched, which are events too:
        # the device total and the top kernels count the kernels alone, each once.
        kernels = [e for e in events if e.device_type != DeviceType.CPU]
        device_ms = sum(e.self_device_time_total for e in kernels) / 1e3
        return {
            "wall_ms": round(wall_s * 1e3, 1),  # under the profiler, whose tracing adds host time
            "device_ms": round(device_ms, 1) if self.cuda else None,
            "gpu_busy": round(device_ms / (wall_s * 1e3), 3) if self.cuda else None,
            "syncs": {k: count[k] for k in SYNC_OPS if k in count},
            "launches": sum(count.get(k, 0) for k in LAUNCH_OPS),
            "aten_ops": sum(n for k, n in count.items() if k.startswith("aten::")),  # nested calls included
            "top_cpu_ops": [(k[:60], round(t / 1e3, 1), n) for k, t, n in cpu[:12]],  # (op, self ms, calls)
            "top_kernels": top_times(kernels, True, 8) if self.cuda else [],
        }


def engine_stats(rollout) -> dict | None:
    """The last engine rollout's waves, buckets, length spread and slot occupancy (`EngineStats`; None for generate):
    what the long tail of completion lengths costs (a wave decodes until its longest row stops)."""
    st = getattr(rollout, "stats", None)
    if st is None:
        return None
    q = sorted(st.lengths)
    return {
        "rows": st.rows, "waves": st.waves, "rows_per_wave": st.rows_per_wave, "bucket_rows": st.bucket_rows,
        "decode_steps": st.steps, "slot_occupancy": st.slot_occupancy, "row_steps": st.row_steps,
        "kept_tokens": st.tokens, "padding_row_steps": st.padding_row_steps, "compactions": st.compactions,
        "prefill_rows": st.prefill_rows, "bucket_trajectory": st.buckets,
        "length_quantiles": {f"p{p}": q[min(len(q) - 1, len(q) * p // 100)] for p in (10, 50, 90, 99)},
        "length_min": q[0], "length_max": q[-1],
    }  # fmt: skip


def run_setup(name: str, args, dev, tmp: str, build=build_model) -> dict:
    import torch
    from datasets import Dataset

    from trace_hf import TraceGRPOConfig, TraceGRPOTrainer

    fp4 = name.endswith("fp4")
    model = build(args, fp4, dev)
    if args.recurrent_chunk_gradient:
        from trace_hf.train import delta_rule

        delta_rule.KERNEL_GRADIENT = False
    if args.rule_over_padding:
        from trace_hf.train import delta_rule

        delta_rule.SKIP_ROW_PADDING = False
    if args.coarse_buckets:
        from trace_hf.rollout.engine import runner

        runner.BUCKETS_PER_OCTAVE = 1
    if args.recompute_experts:
        from trace_hf.quant.experts import fp4_experts

        for m in fp4_experts(model):
            m.last_in_block = False
    vocab = model.config.vocab_size
    tok = word_tokenizer(vocab)
    rng = random.Random(0)
    prompts = [" ".join(f"<{rng.randrange(4, vocab)}>" for _ in range(args.prompt_len)) for _ in range(256)]
    ds = Dataset.from_dict({"prompt": prompts})
    rows = args.prompts * args.num_generations

    def reward(completions, **kw):  # any spread of rewards: the benchmark times the step, not the learning
        return [float(len(c) % 7) for c in completions]

    eos_scale = None
    if args.eos_mean:
        calib = [tok(p)["input_ids"] for p in prompts[:32]]
        eos_scale = calibrate_eos(model, calib, model.config.eos_token_id, args.eos_mean, args.completion)
    peft_config = None
    if args.lora_r:
        from peft import LoraConfig

        from trace_hf.rollout.engine.layouts import layout_of

        # Qwen3: the attention's q/k/v/o; Qwen3.5: those, the Gated DeltaNet's projections and the shared expert.
        peft_config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                                 target_modules=list(layout_of(model.config).lora_targets))  # fmt: skip
    lr = args.learning_rate or (1e-5 if args.lora_r else 1e-6)
    mb = args.micro_batch
    cfg = TraceGRPOConfig(
        output_dir=os.path.join(tmp, name), max_steps=args.steps, learning_rate=lr, per_device_train_batch_size=mb,
        gradient_accumulation_steps=rows // mb, num_generations=args.num_generations,
        max_completion_length=args.completion, temperature=1.0, logging_steps=1, report_to="none",
        bf16=dev.type == "cuda", use_cpu=dev.type != "cuda", activation_checkpointing=dev.type == "cuda",
        save_strategy="no", seed=0, disable_tqdm=True,
        rollout_precision="fp4" if fp4 else "bf16", trace_hints=fp4, routing_replay=fp4,
        rollout_engine="generate" if name.startswith("generate") else "engine",
        train_sampling_strategy="group_by_length" if args.group_by_length else "random",
        token_budget=args.token_budget, gated_delta_rule=args.gated_delta_rule,
        fused_rms_norm=not args.no_fused, fused_rope=not args.no_fused,
        disable_input_dtype_casting=not args.keep_adapter_casts,
        skip_scoring_forward=not args.scoring_forward,
    )  # fmt: skip
    timer = StepTimer()
    phases = PhaseTimer(dev.type == "cuda")
    profiler = LastStepProfile(dev.type == "cuda", args.profile) if args.profile else None
    phases.host = HostProfile(dev.type == "cuda") if args.profile_host else None
    log = StepLog(name, timer, phases)
    callbacks = [timer.callback, phases.callback, log.callback] + ([profiler.callback] if profiler else [])
    callbacks += [phases.host.callback] if phases.host else []
    trainer = TraceGRPOTrainer(model, reward, args=cfg, train_dataset=ds, processing_class=tok, callbacks=callbacks,
                               peft_config=peft_config)  # fmt: skip
    if not name.startswith("generate"):
        from trace_hf.rollout import make_rollout

        engine = make_rollout(trainer.accelerator.unwrap_model(trainer.model), "engine", trainer.generation_config,
                              max_rows=args.wave_rows or None, compaction=not args.no_compaction,
                              share_prefill=not args.no_share_prefill)  # fmt: skip
        phases.watch_engine(engine)
        trainer.rollout = log.rollout = engine
    phases.wrap(trainer, "_get_per_token_logps_and_entropies",
                lambda: "train_forward" if torch.is_grad_enabled() else "logprob_forward_no_grad",
                mask_arg=2)  # (model, input_ids, attention_mask, ...)  # fmt: skip
    phases.wrap(trainer.accelerator, "backward", "backward")
    phases.watch_peak(trainer, "_generate_single_turn", "rollout")
    if profiler:
        profiler.watch(trainer, "_generate_single_turn")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if args.rollout_only:
        res = rollouts_alone(trainer, tok, prompts, args, name, eos_scale, phases)
    else:
        trainer.train()
        world = trainer.accelerator.num_processes
        peak = phases.peak_gib() or 0.0
        peaks = trainer.accelerator.gather(torch.tensor([peak], device=trainer.accelerator.device)).tolist()
        hist = [h for h in trainer.state.log_history if "trace/rollout/tokens_per_second" in h]
        later = hist[1:] or hist
        steps = timer.steps[1:] or timer.steps
        res = {
            "setup": name,
            "rollout_s": statistics.mean(h["trace/rollout/seconds"] for h in later),
            "rollout_tokens_per_s": statistics.mean(h["trace/rollout/tokens_per_second"] for h in later),
            "step_s": statistics.mean(steps),
            "train_side_s": statistics.mean(steps) - statistics.mean(h["trace/rollout/seconds"] for h in later),
            "step_s_all": timer.steps,
            "completion_mean_length": statistics.mean(h.get("completions/mean_length", 0) for h in later),
            "completion_max_length": max(h.get("completions/max_length", 0) for h in later),
            "completion_clipped_ratio": statistics.mean(h.get("completions/clipped_ratio", 0) for h in later),
            "eos_scale": eos_scale,
            "rows": rows,
            "micro_batch": mb,
            "wave_rows": args.wave_rows or None,
            "engine_last_rollout": engine_stats(trainer.rollout),
            "lora_r": args.lora_r,
            "recompute_experts": args.recompute_experts,
            "recurrent_chunk_gradient": args.recurrent_chunk_gradient,
            "rule_over_padding": args.rule_over_padding,
            "coarse_buckets": args.coarse_buckets,
            "token_budget": args.token_budget,
            "gated_delta_rule": trainer.gated_delta_rule,
            "fused_rms_norms": trainer.fused_rms_norms,
            "fused_rope": cfg.fused_rope,
            "uncast_adapters": len(trainer.uncast_adapters),
            "freeze_experts": args.freeze_experts,
            "prefill_bf16_gemms": args.prefill_bf16_gemms,
            "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            "phases_last_step": phases.steps[-1] if phases.steps else None,
            "phases_all_steps": phases.steps,
            "phase_peak_gib_all_steps": phases.peaks,
            "phase_calls_last_step": phases.calls[-1] if phases.calls else None,
            "alloc_retries_all_steps": phases.retries,
            "triton_compiles_all_steps": phases.compiles,
            "rollout_s_last": later[-1]["trace/rollout/seconds"],
            "peak_gib": max(peaks) if dev.type == "cuda" else None,
            "peak_gib_per_gpu": peaks,
            "processes": world,
            "distributed": trainer.accelerator.distributed_type.value,
            "rollout_tokens_per_s_total": world * statistics.mean(h["trace/rollout/tokens_per_second"] for h in later),
            "trace_metrics": {k: v for k, v in later[-1].items() if k.startswith("trace/")},
        }
        if profiler:
            key = {"rollout": "last_rollout", "train": "last_train_side"}.get(args.profile, "last_step")
            res[f"kernels_{key}"] = profiler.kernels  # [(kernel, ms, share of the device time)]
            res[f"kernel_classes_{key}"] = profiler.classes  # {class: device ms}
            res[f"device_ms_{key}"] = profiler.total_ms
        if phases.host:
            res["host_profile_last_step"] = phases.host.phases  # one call of each phase
    del trainer, model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def rollouts_alone(trainer, tok, prompts, args, name: str, eos_scale, phases) -> dict:
    """``--rollout-only``: the rollouts of ``--steps`` generation batches (each prompt ``num_generations`` times, as
    TRL repeats them), nothing trained; the first is the warm-up, as a first step is."""
    seconds, tokens, lengths = [], [], []
    for step in range(args.steps):
        batch = [prompts[(step * args.prompts + i) % len(prompts)] for i in range(args.prompts)]
        ids = [tok(p)["input_ids"] for p in batch for _ in range(args.num_generations)]
        trainer._generate_single_turn(ids, None, None, args.num_generations)
        out, trainer._trace_state.batch = trainer._trace_state.batch, None  # one rollout per batch, as in a step
        seconds.append(out.seconds)
        tokens.append(out.num_tokens)
        lengths.append(max(len(c) for c in out.completion_ids))
        print("ROLLOUT " + json.dumps({"setup": name, "batch": step + 1, "rollout_s": round(out.seconds, 3),
                                        "tokens": out.num_tokens, "longest": lengths[-1], "peak_gib": phases.peak_gib(),
                                        "engine": engine_stats(trainer.rollout)}), flush=True)  # fmt: skip
    later = slice(1, None) if args.steps > 1 else slice(None)
    return {
        "setup": name,
        "rollout_only": True,
        "rollout_s": statistics.mean(seconds[later]),
        "rollout_tokens_per_s": sum(tokens[later]) / sum(seconds[later]),
        "step_s": None,
        "train_side_s": None,
        "rollout_s_all": seconds,
        "rollout_tokens_all": tokens,
        "completion_max_length": max(lengths),
        "eos_scale": eos_scale,
        "rows": args.prompts * args.num_generations,
        "lora_r": args.lora_r,
        "freeze_experts": args.freeze_experts,
        "engine_last_rollout": engine_stats(trainer.rollout),
        "peak_gib": phases.peak_gib(),
    }


def main(argv=None, build_model=build_model) -> int:
    """The benchmark; ``build_model(args, fp4, dev)`` makes each setup's model (another family: grpo_step_qwen35)."""
    args = parse_args(argv)
    import torch

    env = harness.setup_device("grpo_step.py", args.smoke)
    if env is None:
        return 2
    cuda = env.cuda
    if not cuda:
        torch.set_num_threads(1)
    if args.smoke:
        args.layers, args.prompts, args.num_generations, args.prompt_len, args.completion, args.steps = (
            2,
            2,
            4,
            6,
            6,
            2,
        )
    import tempfile

    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    main_process = int(os.environ.get("RANK", 0)) == 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.setups.split(","):
            t0 = time.perf_counter()
            try:
                res = run_setup(name, args, dev, tmp, build_model)
            except Exception as e:  # keep the other setups' numbers
                res = {"setup": name, "error": f"{type(e).__name__}: {e}"}
            res["wall_s"] = time.perf_counter() - t0
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if k != "trace_metrics"}), flush=True)
    base = next((r for r in results if r["setup"] == "generate_bf16" and "error" not in r), None)
    table = []
    for r in results:
        if "error" in r:
            continue
        row = {k: r[k] for k in ("setup", "rollout_tokens_per_s", "rollout_s", "step_s", "train_side_s", "peak_gib")}
        st = r.get("engine_last_rollout")
        if st:  # what the long tail cost the last rollout, and the rows its prefills ran
            keys = ("slot_occupancy", "row_steps", "kept_tokens", "compactions", "prefill_rows")
            row.update({k: st[k] for k in keys})
        if base:
            row["rollout_speedup"] = r["rollout_tokens_per_s"] / base["rollout_tokens_per_s"]
            if base["step_s"] and r["step_s"]:
                row["step_speedup"] = base["step_s"] / r["step_s"]
        table.append(row)
    out = {"args": vars(args), "device": torch.cuda.get_device_name() if cuda else "cpu", "results": results,
           "table": table}  # fmt: skip
    if main_process:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    for row in table:
        print(json.dumps(row))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
