# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`TraceGRPOTrainer`: TRL's GRPO with an FP4 rollout, rollout hints, routing replay and IS correction.

What the subclass changes in `trl.GRPOTrainer` (TRL 1.16), and why:

* `_generate_single_turn`: rolls out through the rollout seam (`trace_hf.rollout`, chosen by `rollout_engine`): the
  CUDA-graph engine or `model.generate`, in ``eval()`` (packed FP4 experts, FP4 KV cache). It returns the sampler's
  log-probs (TRL's plain-HF path returns none) and, when recording, the hints; the trainer keeps that record for the
  generation batch being scored (`_trace_batch`).
* `_generate_and_score_completions`: attaches the hints as per-row ``trace_*`` tensors (so TRL's shuffle and split
  carry them with their rows), computes ``old_per_token_logps`` under the hint-guided forward, the importance-sampling
  ratio against the sampler's log-probs, and the ``trace/*`` metrics.
* `_get_per_token_logps_and_entropies`: every row chunk runs inside `use_hints` for exactly its rows, and in every
  regime with position ids from the attention mask, as `generate` makes them for left-padded prompts.
* `training_step`: keeps the hint context open until backward is done, because gradient checkpointing recomputes
  the forward there.
* `_compute_loss`: applies the IS ratio through TRL's support for per-token advantages.

Packed rollout weights are re-quantized from the master weights after every optimizer step (a global optimizer step
hook in `trace_hf.experts`), and the engine re-quantizes them before every rollout whatever changed them.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field

import torch
from accelerate.utils import is_peft_model
from trl import GRPOConfig, GRPOTrainer
from trl.models import unwrap_model_for_generation
from trl.models.utils import disable_gradient_checkpointing

from .experts import TraceFP4Experts, fp4_experts
from .hints import HintBatch, MismatchReport, aligned_positions, hint_plan, use_hints
from .rollout import ROLLOUT_ENGINES, RolloutOutput, make_rollout
from .trl_options import check_trl_options


# TRL's vLLM importance-sampling fields and their counterparts here (same meaning, applied to the FP4 sampler).
_TRL_IS_FIELDS = (
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
)
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
ROLLOUT_PRECISIONS = ("fp4", "bf16")
HINT_PREFIX = "trace_"


@dataclass
class TraceGRPOConfig(GRPOConfig):
    r"""
    Configuration class for the [`TraceGRPOTrainer`]: [`~trl.GRPOConfig`] plus the TRACE options.

    Rollouts run through the model's own FP4 path (the rollout engine or `model.generate`, in eval mode), never vLLM,
    so `use_vllm` must stay `False`. TRL's `vllm_importance_sampling_{correction,mode,clip_min,clip_max}` have
    counterparts here, `rollout_importance_sampling{,_mode,_clip_min,_clip_max}`, that correct for the FP4 sampler
    instead; setting TRL's raises. The shared quantities are logged under TRL's names
    (`sampling/sampling_logp_difference/{mean,max}`, `sampling/importance_sampling_ratio/{min,mean,max}`), TRACE's own
    under `trace/*`.

    Parameters:
        > Parameters that control the rollout

        rollout_precision (`str`, *optional*, defaults to `"fp4"`):
            `"fp4"`: roll out with the packed FP4 experts (and FP4 KV cache) of a model loaded with
            [`TraceFP4Config`]. `"bf16"`: roll out with the model's unquantized weights; needs a plain model (no
            `TraceFP4Config`) and `trace_hints=False`, `routing_replay=False`. This is the unquantized baseline.
        rollout_engine (`str`, *optional*, defaults to `"auto"`):
            What generates the rollouts (`trace_hf.rollout`). `"engine"`: the static-shape, CUDA-graph decode engine
            (Qwen3 MoE-style models whose every layer is full-attention MoE; FP4 or BF16). `"generate"`:
            `model.generate` (any transformers MoE, Qwen3.5 hybrids included). `"auto"`: the engine on CUDA for a
            model it supports, otherwise `generate`, with one log line that says why.
        trace_hints (`bool`, *optional*, defaults to `True`):
            Record the rollout's FP4 rounding hints at the hinted MoE layers and apply them in every training-side
            forward (old, reference and current log-probs). With `False` the trainer still rolls out in FP4 and trains
            with QAT (the "no hints" baseline).
        routing_replay (`bool`, *optional*, defaults to `True`):
            Replay the rollout's routed experts (top-k ids) in the training forwards; the router weights still come
            from the training logits, so the router keeps learning.
        trace_hint_storage (`str`, *optional*, defaults to `"device"`):
            Where recorded hints live between rollout and training: `"device"` or `"cpu"` (pinned when CUDA exists).

        > Parameters that control the importance-sampling correction against the FP4 sampler

        rollout_importance_sampling (`bool`, *optional*, defaults to `True`):
            Weight the per-token loss by the ratio of the trainer's (hint-guided) probability to the sampler's, as
            TRL does for vLLM rollouts.
        rollout_importance_sampling_mode (`str`, *optional*, defaults to `"token_truncate"`):
            One of `"token_truncate"`, `"token_mask"`, `"sequence_truncate"`, `"sequence_mask"`, with the meaning of
            [`~trl.GRPOConfig.vllm_importance_sampling_mode`].
        rollout_importance_sampling_clip_max (`float`, *optional*, defaults to `3.0`):
            Upper bound of the ratio: truncated to it (`*_truncate`) or masked above it (`*_mask`).
        rollout_importance_sampling_clip_min (`float`, *optional*):
            Lower bound of the ratio, as `rollout_importance_sampling_clip_max`; `None` for no lower bound.

        > Parameters that control logging

        trace_metrics (`bool`, *optional*, defaults to `True`):
            Log the `trace/*` metrics: hint flip rate, routing mismatch, hint coverage and bytes, rollout/train
            log-prob difference and KL, and the IS ratio.
    """

    rollout_precision: str = field(
        default="fp4",
        metadata={
            "help": "'fp4': roll out with the packed FP4 experts of a TraceFP4Config model. 'bf16': roll out with the "
            "unquantized weights of a plain model (the baseline; needs trace_hints=False, routing_replay=False).",
            "choices": list(ROLLOUT_PRECISIONS),
        },
    )
    rollout_engine: str = field(
        default="auto",
        metadata={
            "help": "'engine': the CUDA-graph decode engine (full-attention MoE models); 'generate': model.generate "
            "(any MoE); 'auto': the engine on CUDA when the model is supported, else generate.",
            "choices": list(ROLLOUT_ENGINES),
        },
    )
    trace_hints: bool = field(
        default=True,
        metadata={"help": "Record FP4 rounding hints at rollout and apply them in every training-side forward."},
    )
    routing_replay: bool = field(
        default=True,
        metadata={"help": "Replay the rollout's routed experts (top-k ids) in the training forwards."},
    )
    trace_hint_storage: str = field(
        default="device",
        metadata={
            "help": "Where recorded hints live until training: 'device' or 'cpu'.",
            "choices": ["device", "cpu"],
        },
    )
    rollout_importance_sampling: bool = field(
        default=True,
        metadata={"help": "Correct the loss with the importance-sampling ratio trainer/sampler probability."},
    )
    rollout_importance_sampling_mode: str = field(
        default="token_truncate",
        metadata={
            "help": "How the ratio is formed and bounded: token_truncate, token_mask, sequence_truncate, "
            "sequence_mask (as vllm_importance_sampling_mode).",
            "choices": list(IS_MODES),
        },
    )
    rollout_importance_sampling_clip_max: float | None = field(
        default=3.0,
        metadata={"help": "Upper bound of the IS ratio (truncated to it, or masked above it)."},
    )
    rollout_importance_sampling_clip_min: float | None = field(
        default=None,
        metadata={"help": "Lower bound of the IS ratio (truncated to it, or masked below it); None for none."},
    )
    trace_metrics: bool = field(
        default=True,
        metadata={"help": "Log the trace/* metrics (hint flips, routing mismatch, rollout/train log-prob gap)."},
    )
    # TRL's default `gradient_checkpointing=True` is transformers 5's deprecated alias of `activation_checkpointing`
    # and warns on every config. Unset here; `__post_init__` applies TRL's default under the new name instead.
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Deprecated alias of `activation_checkpointing` (transformers 5); unset, TRL's default (on) applies.",
            "nargs": "?",
            "const": True,
        },
    )

    def __post_init__(self):
        if self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = True  # TRL's GRPOConfig default, without the deprecated name
        super().__post_init__()
        check_trl_options(self)  # TRL options this trainer cannot honour (trace_hf.trl_options)
        if self.use_vllm:
            raise ValueError(
                "TraceGRPOConfig(use_vllm=True) is not supported: TraceGRPOTrainer generates through the model's own "
                "FP4 path (packed experts, FP4 KV cache), which is what the hints are recorded from. Set use_vllm=False."
            )
        if self.use_transformers_continuous_batching:
            raise ValueError(
                "TraceGRPOConfig(use_transformers_continuous_batching=True) is not supported: rollouts must go through "
                "model.generate so that hints and sampler log-probs can be recorded. Set it to False."
            )
        if self.rollout_precision not in ROLLOUT_PRECISIONS:
            raise ValueError(
                f"TraceGRPOConfig.rollout_precision={self.rollout_precision!r}: use 'fp4' (TraceFP4Config model) or "
                "'bf16' (plain model)."
            )
        changed = [f for f in _TRL_IS_FIELDS if getattr(self, f) != GRPOConfig.__dataclass_fields__[f].default]
        if changed:
            raise ValueError(
                f"TraceGRPOConfig: {changed} configure TRL's correction for vLLM rollouts, which TraceGRPOTrainer does "
                "not use. Its correction for the FP4 sampler has the same meaning under rollout_importance_sampling, "
                "rollout_importance_sampling_mode, rollout_importance_sampling_clip_min and "
                "rollout_importance_sampling_clip_max: set those instead."
            )
        if self.rollout_engine not in ROLLOUT_ENGINES:
            raise ValueError(
                f"TraceGRPOConfig.rollout_engine={self.rollout_engine!r}: use 'auto', 'engine' or 'generate'."
            )
        if self.rollout_precision == "bf16" and (self.trace_hints or self.routing_replay):
            raise ValueError(
                "rollout_precision='bf16' rolls out without FP4, so there are no hints or recorded routing to replay: "
                "set trace_hints=False and routing_replay=False."
            )
        if self.trace_hint_storage not in ("device", "cpu"):
            raise ValueError(f"TraceGRPOConfig.trace_hint_storage={self.trace_hint_storage!r}: use 'device' or 'cpu'.")
        if self.rollout_importance_sampling_mode not in IS_MODES:
            raise ValueError(
                f"TraceGRPOConfig.rollout_importance_sampling_mode={self.rollout_importance_sampling_mode!r}: use one "
                f"of {list(IS_MODES)}."
            )
        lo, hi = self.rollout_importance_sampling_clip_min, self.rollout_importance_sampling_clip_max
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(
                f"rollout_importance_sampling_clip_min={lo} is above rollout_importance_sampling_clip_max={hi}."
            )


class TraceGRPOTrainer(GRPOTrainer):
    """[`~trl.GRPOTrainer`] whose rollouts run in FP4 and whose training forwards replay the rollout's hints.

    Takes the arguments of [`~trl.GRPOTrainer`]; `args` must be a [`TraceGRPOConfig`]. The model is a Qwen3 MoE /
    Qwen3.5 MoE (any fused-experts MoE) loaded with `quantization_config=TraceFP4Config()`, or a plain model with
    `rollout_precision="bf16"`.

    PEFT (`peft_config=LoraConfig(...)` or a `PeftModel`): LoRA on non-expert linears (e.g. `q_proj`, `v_proj`) is
    supported; the FP4 experts are then frozen and keep their QAT forward, or are frozen packed FP4 with
    `TraceFP4Config(freeze_experts=True)`. The rollout engine merges LoRA on the attention projections into its
    weights at every rollout. LoRA on the fused experts (`target_parameters`) is refused: the packed FP4 rollout
    weights are quantized from the base parameters (or are frozen codes) and would not contain the adapter.
    """

    _tag_names = ["trl", "grpo", "trace-hf"]
    _name = "TRACE-GRPO"

    def __init__(self, model, reward_funcs=None, args: TraceGRPOConfig | None = None, *pargs, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path or type(model).__name__
            args = TraceGRPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-TRACE")
        if not isinstance(args, TraceGRPOConfig):
            raise TypeError(
                f"TraceGRPOTrainer needs args=TraceGRPOConfig(...), got {type(args).__name__}; TraceGRPOConfig takes "
                "every GRPOConfig argument plus the TRACE options."
            )
        peft_config = kwargs.get("peft_config")
        if peft_config is not None and not isinstance(model, str):
            _check_peft(model, peft_config)
        super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        self._trace_validate_model()
        self._trace_rows: HintBatch | None = None  # hints of the rows passed to the next log-prob forwards
        self._trace_batch: RolloutOutput | None = None  # the generation batch being scored
        self._trace_rollout = None  # the rollout path (trace_hf.rollout), chosen at the first rollout
        self._trace_reports: list[MismatchReport] | None = None  # collects reports of the old-logp forwards
        self._trace_stack: contextlib.ExitStack | None = None  # keeps the training forward's context to backward
        self._trace_train_reports: list[MismatchReport] = []

    # ------------------------------------------------------------------------------------------------------
    # Model checks
    # ------------------------------------------------------------------------------------------------------

    def _trace_validate_model(self) -> None:
        model = self.accelerator.unwrap_model(self.model)
        if is_peft_model(model):
            _check_peft(model, model.peft_config.get("default"))
        experts = fp4_experts(model)
        args = self.args
        if args.rollout_precision == "fp4" and not experts:
            raise ValueError(
                "rollout_precision='fp4' needs a model loaded with quantization_config=TraceFP4Config() (its routed "
                "experts become TraceFP4Experts); this model has none. Load it with TraceFP4Config, or set "
                "rollout_precision='bf16', trace_hints=False, routing_replay=False for the unquantized baseline."
            )
        if args.rollout_precision == "bf16" and experts:
            raise ValueError(
                "rollout_precision='bf16' is the unquantized baseline, but this model was loaded with TraceFP4Config "
                "(FP4 experts). Load the plain model (no quantization_config), or use rollout_precision='fp4'."
            )
        if args.trace_hints and not any(m.hinted for m in experts):
            raise ValueError(
                "trace_hints=True but the model has no hinted MoE layers (TraceFP4Config(hint_layers=0) or "
                "activations='none'). Load it with hint_layers > 0 (default: half of the MoE layers) and "
                "activations='fp4', or set trace_hints=False."
            )
        self._trace_fp4 = bool(experts)
        self._trace_fmt = experts[0].fmt if experts else None

    def _trace_core(self, model: torch.nn.Module) -> torch.nn.Module:
        """The transformer backbone inside any wrapper (DDP, PEFT, the CausalLM head): the module whose `__call__`
        every forward goes through (PEFT calls the CausalLM's `forward` directly, so hooks there would not fire)."""
        model = self.accelerator.unwrap_model(model)
        if is_peft_model(model):
            model = model.get_base_model()
        return getattr(model, "base_model", model)

    @property
    def _trace_records(self) -> bool:
        """Whether rollouts record routing (and hints): needed for hints, replay, or the mismatch metrics."""
        a = self.args
        return self._trace_fp4 and (a.trace_hints or a.routing_replay or a.trace_metrics)

    @property
    def _trace_replays(self) -> bool:
        """Whether the training forward itself needs the recorded hints/routing."""
        return self._trace_fp4 and (self.args.trace_hints or self.args.routing_replay)

    @contextlib.contextmanager
    def _trace_forward(self, model, hints: HintBatch | None, attention_mask: torch.Tensor):
        """The context of one training-side forward: hints and routing replay for its rows, position ids always."""
        core = self._trace_core(model)
        # No hints, a plain reference model, or an eval-mode forward (evaluation: the rollout path, nothing to guide).
        if hints is None or not fp4_experts(core) or not core.training:
            with aligned_positions(core, attention_mask):
                yield None
            return
        replay, apply = self.args.routing_replay, self.args.trace_hints
        with use_hints(core, hints, attention_mask, routing_replay=replay, apply_hints=apply) as report:
            yield report

    # ------------------------------------------------------------------------------------------------------
    # Rollout
    # ------------------------------------------------------------------------------------------------------

    def _trace_rollout_for(self, model):
        """The rollout path (`trace_hf.rollout`), chosen once from `rollout_engine` and the unwrapped model."""
        if self._trace_rollout is None:
            self._trace_rollout = make_rollout(model, self.args.rollout_engine, self.generation_config)
        return self._trace_rollout

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None or multimodal_fields:
            raise NotImplementedError("TraceGRPOTrainer supports text-only models; got images or multimodal inputs.")
        if self._trace_batch is not None:
            raise NotImplementedError(
                "TraceGRPOTrainer rolls out once per generation batch; tool calling (a second generation over the "
                "same rows) is not supported, because the hints of tool-result tokens would be missing."
            )
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=self.generation_kwargs,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            rollout = self._trace_rollout_for(unwrapped)
            was_training = unwrapped.training
            unwrapped.eval()  # the rollout path: packed FP4 experts, FP4 KV cache
            try:
                out = rollout(
                    unwrapped,
                    prompt_ids,
                    self.generation_config,
                    record=self._trace_records,
                    storage=self.args.trace_hint_storage,
                )
            finally:
                unwrapped.train(was_training)
        self._trace_batch = out
        return out.completion_ids, out.logprobs

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        # The record of this generation batch: set by the rollout, read by TRL's own old/ref log-prob forwards
        # inside super (rows still in generation order), dropped once the batch is scored.
        self._trace_batch = None
        try:
            output = super()._generate_and_score_completions(inputs)
            batch = self._trace_batch
        finally:
            self._trace_batch = None
        hints = batch.hints if batch is not None else None
        if batch is not None and batch.seconds > 0:
            metrics = self._metrics[mode]
            metrics["trace/rollout/seconds"].append(batch.seconds)
            metrics["trace/rollout/tokens_per_second"].append(batch.num_tokens / batch.seconds)
        if hints is not None and len(hints) != output["prompt_ids"].size(0):
            raise RuntimeError(
                f"TraceGRPOTrainer recorded hints for {len(hints)} rows but the batch has {output['prompt_ids'].size(0)}."
            )

        args = self.args
        sampling = output["sampling_per_token_logps"]
        mask = output["completion_mask"] * output.get("tool_mask", 1)
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        batch_size = args.per_device_train_batch_size if mode == "train" else args.per_device_eval_batch_size

        reports: list[MismatchReport] = []
        if args.rollout_importance_sampling or args.trace_metrics:
            self._trace_rows, self._trace_reports = hints, reports
            try:
                with torch.no_grad(), disable_gradient_checkpointing(self.model, args.gradient_checkpointing_kwargs):
                    old, _, _ = self._get_per_token_logps_and_entropies(
                        self.model,
                        input_ids,
                        attention_mask,
                        input_ids.size(1) - output["prompt_ids"].size(1),
                        batch_size=batch_size,
                    )
            finally:
                self._trace_rows, self._trace_reports = None, None
            if args.rollout_importance_sampling or "old_per_token_logps" in output:
                output["old_per_token_logps"] = old
            if args.rollout_importance_sampling:
                output["importance_sampling_ratio"] = self._trace_is_ratio(old, sampling, mask)
            if args.trace_metrics:
                self._trace_log_metrics(mode, old, sampling, mask, reports, output.get("importance_sampling_ratio"))

        if hints is not None and self._trace_replays:
            output.update(hints.to_inputs(HINT_PREFIX))
        return output

    # ------------------------------------------------------------------------------------------------------
    # Importance sampling and metrics
    # ------------------------------------------------------------------------------------------------------

    def _trace_is_ratio(self, old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """exp(trainer logp - sampler logp), per token [B, T] or per sequence [B, 1], bounded as in TRL's vLLM IS."""
        args = self.args
        diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
        if args.rollout_importance_sampling_mode.startswith("sequence"):
            diff = diff.sum(-1, keepdim=True)
        ratio = torch.exp(diff)
        lo, hi = args.rollout_importance_sampling_clip_min, args.rollout_importance_sampling_clip_max
        if args.rollout_importance_sampling_mode.endswith("truncate"):
            return torch.clamp(ratio, min=lo, max=hi)
        lo = -math.inf if lo is None else lo
        hi = math.inf if hi is None else hi
        return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)

    def _trace_log_metrics(self, mode, old, sampling, mask, reports, ratio) -> None:
        """`trace/*` metrics, reduced over processes as sums and counts (token-weighted, not mean of means)."""
        device = old.device
        m = mask.bool() & ~torch.isnan(sampling)
        d = (old - sampling)[m]
        k3 = torch.expm1(d) - d  # KL(sampler || trainer) estimator on the sampler's own tokens
        report = MismatchReport()
        for r in reports:
            report.merge(r)
        flips = sum(int(v) for v in report.flips.values())
        elements = sum(int(v) for v in report.elements.values())
        # Every process hints the same sites (one config), so the per-site counts reduce position by position.
        sites = tuple(hint_plan(self._trace_core(self.model))) if self._trace_fp4 else ()
        by_site = report.counts_by_site()
        site_counts = [c for site in sites for c in by_site.get(site, (0, 0))]
        if ratio is not None:
            r = ratio.flatten() if ratio.size(-1) == 1 else ratio[m]
            is_sum, is_n = r.sum(), r.numel()
        else:
            is_sum, is_n = 0.0, 0
        sums = torch.tensor(
            [
                d.abs().sum(),
                d.numel(),
                k3.sum(),
                flips,
                elements,
                int(report.routing_diff),
                report.routing_total,
                report.hinted_tokens,
                report.real_tokens,
                is_sum,
                is_n,
                report.hint_bytes_per_token,
                *site_counts,
            ],
            dtype=torch.float64,
            device=device,
        )
        sums = self.accelerator.reduce(sums, reduction="sum")
        dmax = self.accelerator.gather(d.abs().max() if d.numel() else torch.zeros((), device=device)).max()
        s = sums.tolist()
        n_proc = self.accelerator.num_processes
        metrics = self._metrics[mode]

        def put(key, a, b):  # a rate over nothing is not logged: it would claim agreement it never checked
            if b:
                metrics[key].append(a / b)

        # TRL's names where TRL logs the same quantity for vLLM rollouts; trace/* for what is TRACE's own.
        put("sampling/sampling_logp_difference/mean", s[0], s[1])
        if s[1]:
            metrics["sampling/sampling_logp_difference/max"].append(dmax.item())
        put("trace/kl_rollout_train", s[2], s[1])
        if self._trace_fp4:
            put("trace/hint_flip_rate", s[3], s[4])
            for j, site in enumerate(sites):
                put(f"trace/hint_flip_rate/{site}", s[12 + 2 * j], s[13 + 2 * j])
            put("trace/routing_mismatch", s[5], s[6])
            put("trace/hint_coverage", s[7], s[8])
            # Bytes a rollout must keep for training; without trace_hints they are recorded only to measure flips.
            metrics["trace/hint_bytes_per_token"].append(s[11] / n_proc if self.args.trace_hints else 0.0)
        if ratio is not None and s[10]:
            r = ratio.flatten() if ratio.size(-1) == 1 else ratio[m]
            inf = torch.tensor(math.inf, device=device)
            lo = self.accelerator.gather(r.min() if r.numel() else inf).min()
            hi = self.accelerator.gather(r.max() if r.numel() else -inf).max()
            metrics["sampling/importance_sampling_ratio/min"].append(lo.item())
            metrics["sampling/importance_sampling_ratio/mean"].append(s[9] / s[10])
            metrics["sampling/importance_sampling_ratio/max"].append(hi.item())

    # ------------------------------------------------------------------------------------------------------
    # Training-side forwards
    # ------------------------------------------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **kwargs,
    ):
        if any(v is not None for v in kwargs.values()):
            raise NotImplementedError(
                f"TraceGRPOTrainer supports text-only models; got multimodal inputs {sorted(kwargs)}."
            )
        rows = self._trace_rows
        if rows is None and self._trace_batch is not None:
            rows = self._trace_batch.hints  # TRL's forwards during scoring: the rollout's rows, in its order
        if rows is not None and len(rows) != input_ids.size(0):
            raise RuntimeError(
                f"TraceGRPOTrainer: {len(rows)} hint rows for a log-prob forward over {input_ids.size(0)} rows."
            )
        n = input_ids.size(0)
        keep_open = self._trace_stack is not None and torch.is_grad_enabled()
        # A training forward keeps its context until backward: one chunk, so one set of hooks is installed.
        batch_size = n if keep_open else (batch_size or n)
        logps, entropies, aux = [], [], []
        for start in range(0, n, batch_size):
            end = min(start + batch_size, n)
            ctx = self._trace_forward(model, None if rows is None else rows[start:end], attention_mask[start:end])
            if keep_open:
                report = self._trace_stack.enter_context(ctx)
                if report is not None:
                    self._trace_train_reports.append(report)
                out = super()._get_per_token_logps_and_entropies(
                    model,
                    input_ids[start:end],
                    attention_mask[start:end],
                    logits_to_keep,
                    compute_entropy=compute_entropy,
                    compute_aux_loss=compute_aux_loss,
                )
            else:
                with ctx as report:
                    out = super()._get_per_token_logps_and_entropies(
                        model,
                        input_ids[start:end],
                        attention_mask[start:end],
                        logits_to_keep,
                        compute_entropy=compute_entropy,
                        compute_aux_loss=compute_aux_loss,
                    )
            if report is not None and self._trace_reports is not None:
                self._trace_reports.append(report)
            logps.append(out[0])
            entropies.append(out[1])
            aux.append(out[2])
        return (
            torch.cat(logps, dim=0),
            torch.cat(entropies, dim=0) if compute_entropy else None,
            torch.stack(aux).mean() if compute_aux_loss else None,
        )

    def training_step(self, model, inputs, num_items_in_batch):
        # Backward runs inside Trainer.training_step; the hint context entered by the training forward stays open
        # until it returns, so checkpointed layers recompute with the same hints and routing.
        self._trace_train_reports = []
        with contextlib.ExitStack() as stack:
            self._trace_stack = stack
            try:
                loss = super().training_step(model, inputs, num_items_in_batch)
            finally:
                self._trace_stack = None
        if self.args.trace_metrics and self._trace_replays:
            self._trace_log_train_reports(self._trace_train_reports)
        self._trace_train_reports = []
        return loss

    def _trace_log_train_reports(self, reports: list[MismatchReport]) -> None:
        """What the hints corrected in the gradient forward itself (after TRL's shuffle and split): a live check
        that every row met its own hints (misaligned hints would disagree with nearest rounding about half the time).
        """
        report = MismatchReport()
        for r in reports:
            report.merge(r)
        sums = torch.tensor(
            [
                sum(int(v) for v in report.flips.values()),
                sum(int(v) for v in report.elements.values()),
                int(report.routing_diff),
                report.routing_total,
            ],
            dtype=torch.float64,
            device=self.accelerator.device,
        )
        flips, elements, diff, total = self.accelerator.reduce(sums, reduction="sum").tolist()
        if elements:
            self._metrics["train"]["trace/train/hint_flip_rate"].append(flips / elements)
        if total:
            self._metrics["train"]["trace/train/routing_mismatch"].append(diff / total)

    def _compute_loss(self, model, inputs):
        keys = HintBatch.input_keys(HINT_PREFIX)
        if self._trace_replays and all(k in inputs for k in keys):
            self._trace_rows = HintBatch.from_inputs(inputs, self._trace_fmt, self._trace_hint_layers(), HINT_PREFIX)
        ratio = inputs.get("importance_sampling_ratio")
        if ratio is not None and self.loss_type != "vespo":
            # per_token_loss * r == loss computed with advantages * r for every TRL loss here (r >= 0 keeps the sign
            # that clipping looks at), and TRL accepts [B, T] advantages from subclasses; VESPO reads the ratio itself.
            advantages = inputs["advantages"]
            advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
            inputs = {**inputs, "advantages": advantages * ratio}
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._trace_rows = None

    def _trace_hint_layers(self) -> tuple[int, ...]:
        return tuple(m.moe_index for m in fp4_experts(self._trace_core(self.model)) if m.hinted)


def _check_peft_targets(model, peft_config) -> None:
    """A list of target_modules that names a module the model lacks is a typo, not a wish to skip it."""
    targets = getattr(peft_config, "target_modules", None)
    if not isinstance(targets, (list, tuple, set)) or getattr(peft_config, "target_parameters", None):
        return  # a regex or "all-linear" is PEFT's to match; with target_parameters PEFT may match modules differently
    names = [n for n, _ in model.named_modules() if n]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(
            f"The PEFT config's target_modules {missing} name no module of {type(model).__name__}; its linear layers "
            f"are {leaves}. For LoRA on the attention use target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']."
        )


def _check_peft(model, peft_config) -> None:
    """Refuse adapters on the FP4 experts: the packed rollout weights are quantized from the base parameters only."""
    if peft_config is None or not isinstance(model, torch.nn.Module):
        return
    if not is_peft_model(model):
        _check_peft_targets(model, peft_config)
    experts = {name for name, m in model.named_modules() if isinstance(m, TraceFP4Experts)}
    if not experts:
        return
    frozen = any(m.frozen for m in model.modules() if isinstance(m, TraceFP4Experts))
    targets = list(getattr(peft_config, "target_parameters", None) or [])
    hit = [t for t in targets if t.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj")]
    wrapped = [
        name for name, m in model.named_modules() if isinstance(getattr(m, "base_layer", None), TraceFP4Experts)
    ]
    if (hit or wrapped) and frozen:
        raise ValueError(
            f"PEFT adapters on the routed experts ({hit or wrapped}) are not supported with "
            "TraceFP4Config(freeze_experts=True): the frozen experts are packed FP4 codes with no weight for an adapter "
            "to add to, and the rollout kernels read those codes only, so the rollout would not see the adapter. "
            "Target the attention projections (target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']), or load "
            "without freeze_experts and train the experts fully."
        )
    if hit or wrapped:
        raise ValueError(
            f"PEFT adapters on the FP4 routed experts ({hit or wrapped}) are not supported: rollouts run from packed "
            "FP4 weights quantized from the base expert parameters, which would not include the adapter, so rollout "
            "and training would compute different functions. Target non-expert linears instead (e.g. "
            "target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']), or train the experts fully (no PEFT)."
        )
    if getattr(peft_config, "target_modules", None) and any(
        isinstance(t, str) and t.endswith("experts") for t in peft_config.target_modules
    ):
        warnings.warn("target_modules names an experts module; PEFT cannot wrap TraceFP4Experts.", stacklevel=3)
