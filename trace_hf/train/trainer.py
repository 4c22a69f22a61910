# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`TraceGRPOTrainer`: TRL's GRPO with an FP4 rollout, rollout hints, routing replay and IS correction.

What the subclass changes in `trl.GRPOTrainer` (TRL 1.16), and why:

* `_generate_single_turn`: rolls out through the rollout seam (`trace_hf.rollout`, chosen by `rollout_engine`): the
  CUDA-graph engine or `model.generate`, in ``eval()`` (packed FP4 experts, FP4 KV cache). It returns the sampler's
  log-probs (TRL's plain-HF path returns none) and, when recording, the hints; the trainer keeps that record for the
  generation batch being scored (`StepState.batch`).
* `_generate_and_score_completions`: attaches the hints as per-row ``trace_*`` tensors (so TRL's shuffle and split
  carry them with their rows), computes ``old_per_token_logps`` under the hint-guided forward, the importance-sampling
  ratio against the sampler's log-probs, and the ``trace/*`` metrics; where TRL keeps old log-probs, its own
  forward of them is that scoring forward (`StepState.trl_old`); with ``skip_scoring_forward``, where TRL keeps
  none, the loss forward computes the ratio and the metrics instead (`_trace_score_in_loss`).
* `_get_per_token_logps_and_entropies`: every row chunk runs inside `use_hints` for exactly its rows, and in every
  regime with position ids from the attention mask, as `generate` makes them for left-padded prompts; each chunk
  runs only the columns its rows use (TRL pads every completion to the batch's longest). With
  ``token_budget`` the forwards are packed padding-free instead (`_packed_logps_and_entropies`).
* `_prepare_inputs`: with ``train_sampling_strategy="group_by_length"``, the micro-batches hold rows of similar
  length instead of TRL's random order (`trace_hf.train.grouping`).
* `training_step`: keeps the hint context open until backward is done, because gradient checkpointing recomputes
  the forward there.
* `_compute_loss`: applies the IS ratio (`trace_hf.train.importance`) through TRL's per-token advantages.
* `log`: with ``skip_scoring_forward``, logs the rollout metrics the loss forwards added up since the last log.

State that TRL's hooks hand each other lives in one declared `StepState` (`_trace_state`; TRL owns `_step`); the config is
`trace_hf.train.config`, the metric reductions `trace_hf.train.metrics`.

Packed rollout weights are re-quantized from the master weights after every optimizer step (a global optimizer step
hook, `trace_hf.quant.freshness`), and the engine re-quantizes them before every rollout whatever changed them.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field

import torch
from accelerate.utils import is_peft_model
from trl import GRPOTrainer
from trl.models import unwrap_model_for_generation
from trl.models.utils import disable_gradient_checkpointing

from ..hints import HintBatch, MismatchReport, aligned_positions, hint_plan, use_hints
from ..quant.experts import TraceFP4Experts, fp4_experts
from ..rollout import RolloutOutput, make_rollout
from .adapter_casts import autocast_adapter_inputs, uncastable_adapters
from .config import TraceGRPOConfig
from .delta_rule import recurrent_values, resolve_gated_delta_rule
from .grouping import group_by_length
from .importance import importance_sampling_ratio
from .metrics import log_ratio, reduce_sums
from .packing import packed_attention, resolve_token_budget, sequence_mixers, token_chunks, unpack
from .rms_norm import fuse_rms_norms
from .rope import fused_rope


#: Prefix of the hint columns in the trainer's inputs (TRL shuffles and splits them with their rows).
HINT_PREFIX = "trace_"


@dataclass
class StepState:
    """What TRL's hooks of one generation batch / training step hand each other (`TraceGRPOTrainer._trace_state`).

    Attributes:
        batch: the rollout of the generation batch being scored (set by the rollout, dropped once it is scored).
        rows: hints of the rows the next log-prob forwards see, in their order (after TRL's shuffle and split).
        reports: collects the `MismatchReport` of each scoring forward, while set.
        stack: the training forward's hint context, kept open until its backward is done.
        train_reports: the reports of the training forwards of the current step.
        loss_inputs: with ``skip_scoring_forward``, the inputs of the loss being computed, which its forward completes
            with the IS ratio from its own log-probs (TRL reads them only after that forward).
        scored: with ``skip_scoring_forward``, what the loss forwards since the last log scored (`_scored_sums`,
            added up on the device), logged by `log`.
        scored_reports: the reports of those forwards.
        trl_old: while a generation batch is scored, the reports of TRL's own old-log-prob forward (its first no-grad
            forward of the policy, before any reference one), and ``trl_old_logps`` its log-probs: that forward is
            the scoring forward, and none other runs.
    """

    batch: RolloutOutput | None = None
    rows: HintBatch | None = None
    reports: list[MismatchReport] | None = None
    stack: contextlib.ExitStack | None = None
    train_reports: list[MismatchReport] = field(default_factory=list)
    loss_inputs: dict | None = None
    scored: dict[str, torch.Tensor] | None = None
    scored_reports: list[MismatchReport] = field(default_factory=list)
    trl_old: list[MismatchReport] | None = None
    trl_old_logps: torch.Tensor | None = None

    def hint_rows(self) -> HintBatch | None:
        """The rows' hints: those set for this forward, else (TRL's own forwards while scoring) the rollout's, in
        rollout order."""
        if self.rows is not None:
            return self.rows
        return self.batch.hints if self.batch is not None else None


class TraceGRPOTrainer(GRPOTrainer):
    """[`~trl.GRPOTrainer`] whose rollouts run in FP4 and whose training forwards replay the rollout's hints.

    Takes the arguments of [`~trl.GRPOTrainer`]; `args` must be a [`TraceGRPOConfig`]. The model is a Qwen3 MoE /
    Qwen3.5 MoE (any fused-experts MoE) loaded with `quantization_config=TraceFP4Config()`, or a plain model with
    `rollout_precision="bf16"`.

    PEFT (`peft_config=LoraConfig(...)` or a `PeftModel`): LoRA on non-expert linears (e.g. `q_proj`, `v_proj`) is
    supported; the FP4 experts are then frozen and keep their QAT forward, or are frozen packed FP4 with
    `TraceFP4Config(freeze_experts=True)`. The rollout engine folds LoRA into its weights at every rollout, on the
    projections its family's `Layout.lora_targets` names (Qwen3: attention; Qwen3.5: attention, Gated DeltaNet and
    shared expert). LoRA on the fused experts (`target_parameters`) is refused: the packed FP4 rollout
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
        #: How many RMSNorms run as `trace_hf.train.rms_norm.FusedRMSNorm` (`fused_rms_norm`).
        self.fused_rms_norms = fuse_rms_norms(self.model) if self.args.fused_rms_norm else 0
        #: The PEFT adapters the training-side forwards feed their input uncast (`disable_input_dtype_casting`): empty
        #: unless those forwards run under autocast, where the cast would be undone.
        self.uncast_adapters = self._uncast_adapters()
        self.rollout = None  # the rollout path (`trace_hf.rollout`), chosen at the first rollout
        self._trace_state = StepState()
        experts = self._trace_validate_model()
        #: `gated_delta_rule` for this model: "recurrent" or "chunk" ("auto" resolved).
        self.gated_delta_rule = resolve_gated_delta_rule(
            self.accelerator.unwrap_model(self.model), self.args.gated_delta_rule
        )
        #: `token_budget` for this model: an int, "auto" (the padded micro-batch's tokens) or None (padded forwards).
        self.token_budget = resolve_token_budget(self.accelerator.unwrap_model(self.model), self.args.token_budget)
        #: Whether packed rows reach Gated DeltaNet layers padded, so that a scoring forward's budget counts padding.
        self.packs_padded_rows = bool(sequence_mixers(self.accelerator.unwrap_model(self.model)))
        self._fp4 = bool(experts)  # an FP4 model (TraceFP4Config), not the BF16 baseline
        self._fmt = experts[0].fmt if experts else None
        self._hint_layers = tuple(m.moe_index for m in experts if m.hinted)  # what HintBatch.from_inputs rebuilds

    # ------------------------------------------------------------------------------------------------------
    # Model checks
    # ------------------------------------------------------------------------------------------------------

    def _trace_validate_model(self) -> list[TraceFP4Experts]:
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
        return experts

    def _uncast_adapters(self) -> list[torch.nn.Module]:
        if not self.args.disable_input_dtype_casting:
            return []
        with self.accelerator.autocast():  # what every training-side forward runs under (TRL's and the packed ones)
            amp = torch.is_autocast_enabled(self.accelerator.device.type)
        return uncastable_adapters(self.accelerator.unwrap_model(self.model)) if amp else []

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
        return self._fp4 and (a.trace_hints or a.routing_replay or a.trace_metrics)

    @property
    def _trace_replays(self) -> bool:
        """Whether the training forward itself needs the recorded hints/routing."""
        return self._fp4 and (self.args.trace_hints or self.args.routing_replay)

    @contextlib.contextmanager
    def _trace_forward(self, model, hints: HintBatch | None, attention_mask: torch.Tensor, packed: bool = False):
        """The context of one training-side forward: hints and routing replay for its rows, position ids always.
        ``packed``: the forward feeds the real tokens of ``attention_mask``'s rows as one sequence (`use_hints`)."""
        core = self._trace_core(model)
        with contextlib.ExitStack() as stack:
            if packed:
                stack.enter_context(packed_attention(core, attention_mask.sum(1).tolist()))
            if self.gated_delta_rule == "recurrent":
                stack.enter_context(recurrent_values(core))
            if self.args.fused_rope:
                stack.enter_context(fused_rope(core))
            if self.uncast_adapters:
                stack.enter_context(autocast_adapter_inputs(self.uncast_adapters))
            # No hints, a plain reference model, or an eval-mode forward (evaluation: the rollout path, nothing to
            # guide).
            if hints is None or not core.training or not any(isinstance(m, TraceFP4Experts) for m in core.modules()):
                stack.enter_context(aligned_positions(core, attention_mask, packed))
                yield None
                return
            replay, apply = self.args.routing_replay, self.args.trace_hints
            yield stack.enter_context(
                use_hints(core, hints, attention_mask, routing_replay=replay, apply_hints=apply, packed=packed)
            )

    # ------------------------------------------------------------------------------------------------------
    # Rollout
    # ------------------------------------------------------------------------------------------------------

    def _trace_rollout_for(self, model):
        """The rollout path (`trace_hf.rollout`), chosen once from `rollout_engine` and the unwrapped model."""
        if self.rollout is None:
            a = self.args
            self.rollout = make_rollout(
                model, a.rollout_engine, self.generation_config, max_rows=a.rollout_max_rows,
                free_memory_fraction=a.rollout_free_memory_fraction, compaction=a.rollout_compaction,
                share_prefill=a.rollout_share_prefill,
            )  # fmt: skip
        return self.rollout

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None or multimodal_fields:
            raise NotImplementedError("TraceGRPOTrainer supports text-only models; got images or multimodal inputs.")
        if self._trace_state.batch is not None:
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
        self._trace_state.batch = out
        return out.completion_ids, out.logprobs

    def _prepare_inputs(self, generation_batch):
        # TRL shuffles a fresh generation batch and splits it into micro-batches; group_by_length regroups those rows.
        fresh = self.model.training and (
            self._step % (self.args.steps_per_generation * self.num_iterations) == 0 or self._buffered_inputs is None
        )
        inputs = super()._prepare_inputs(generation_batch)
        if fresh and getattr(self.args, "train_sampling_strategy", "random") == "group_by_length":
            self._buffered_inputs = group_by_length(self._buffered_inputs)
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        # The record of this generation batch: set by the rollout, read by TRL's own old/ref log-prob forwards
        # inside super (rows still in generation order), dropped once the batch is scored.
        step = self._trace_state
        step.batch, step.trl_old, step.trl_old_logps = None, [], None
        try:
            output = super()._generate_and_score_completions(inputs)
            batch, reports, old = step.batch, step.trl_old, step.trl_old_logps
        finally:
            step.batch, step.trl_old, step.trl_old_logps = None, None, None
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

        if (args.rollout_importance_sampling or args.trace_metrics) and not self._scores_in_loss(output):
            # Unless TRL kept as old log-probs the very tensor its policy forward got here, the scoring forward runs.
            if old is None or output.get("old_per_token_logps") is not old:
                reports = []
                step.rows, step.reports = hints, reports
                try:
                    with (
                        torch.no_grad(),
                        disable_gradient_checkpointing(self.model, args.gradient_checkpointing_kwargs),
                    ):
                        old, _, _ = self._get_per_token_logps_and_entropies(
                            self.model,
                            input_ids,
                            attention_mask,
                            input_ids.size(1) - output["prompt_ids"].size(1),
                            batch_size=batch_size,
                        )
                finally:
                    step.rows, step.reports = None, None
            if args.rollout_importance_sampling or "old_per_token_logps" in output:
                output["old_per_token_logps"] = old
            if args.rollout_importance_sampling:
                a = args
                output["importance_sampling_ratio"] = importance_sampling_ratio(
                    old, sampling, mask, a.rollout_importance_sampling_mode, a.rollout_importance_sampling_clip_min,
                    a.rollout_importance_sampling_clip_max,
                )  # fmt: skip
            if args.trace_metrics:
                scored = _scored_sums(old, sampling, mask, output.get("importance_sampling_ratio"))
                self._trace_log_metrics(mode, scored, reports)

        if hints is not None and self._trace_replays:
            output.update(hints.to_inputs(HINT_PREFIX))
        return output

    # ------------------------------------------------------------------------------------------------------
    # Importance sampling and metrics
    # ------------------------------------------------------------------------------------------------------

    def _trace_log_metrics(self, mode, scored: dict[str, torch.Tensor], reports) -> None:
        """`trace/*` metrics of the scored tokens (`_scored_sums`) and the reports of their forwards, token-weighted
        over processes (`trace_hf.train.metrics`)."""
        report = MismatchReport.merged(reports)
        sites = tuple(hint_plan(self._trace_core(self.model))) if self._fp4 else ()  # the same on every process
        sums = {
            **{k: scored[k] for k in ("logp_diff", "tokens", "kl")},
            "flips": report.total_flips,
            "elements": report.total_elements,
            "routing_diff": int(report.routing_diff),
            "routing_total": report.routing_total,
            "hinted_tokens": report.hinted_tokens,
            "real_tokens": report.real_tokens,
            "ratio": scored.get("ratio", 0.0),
            "ratio_n": scored.get("ratio_n", 0),
            "hint_bytes": report.hint_bytes_per_token,
        }
        by_site = report.counts_by_site()
        for site in sites:
            sums[f"flips/{site}"], sums[f"elements/{site}"] = by_site.get(site, (0, 0))
        s = reduce_sums(self.accelerator, sums)
        dmax = self.accelerator.gather(scored["logp_diff_max"]).max()
        metrics = self._metrics[mode]
        # TRL's names where TRL logs the same quantity for vLLM rollouts; trace/* for what is TRACE's own.
        log_ratio(metrics, "sampling/sampling_logp_difference/mean", s["logp_diff"], s["tokens"])
        if s["tokens"]:
            metrics["sampling/sampling_logp_difference/max"].append(dmax.item())
        log_ratio(metrics, "trace/kl_rollout_train", s["kl"], s["tokens"])
        if self._fp4:
            log_ratio(metrics, "trace/hint_flip_rate", s["flips"], s["elements"])
            for site in sites:
                log_ratio(metrics, f"trace/hint_flip_rate/{site}", s[f"flips/{site}"], s[f"elements/{site}"])
            log_ratio(metrics, "trace/routing_mismatch", s["routing_diff"], s["routing_total"])
            log_ratio(metrics, "trace/hint_coverage", s["hinted_tokens"], s["real_tokens"])
            # Bytes a rollout must keep for training; without trace_hints they are recorded only to measure flips.
            n_proc = self.accelerator.num_processes
            metrics["trace/hint_bytes_per_token"].append(s["hint_bytes"] / n_proc if self.args.trace_hints else 0.0)
        if "ratio" in scored and s["ratio_n"]:
            lo = self.accelerator.gather(scored["ratio_min"]).min()
            hi = self.accelerator.gather(scored["ratio_max"]).max()
            metrics["sampling/importance_sampling_ratio/min"].append(lo.item())
            metrics["sampling/importance_sampling_ratio/mean"].append(s["ratio"] / s["ratio_n"])
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
        step = self._trace_state
        trl_old = step.trl_old is not None and step.trl_old_logps is None and model is self.model
        if trl_old:  # TRL's old-log-prob forward, inside `_generate_and_score_completions`: it is the scoring one
            step.reports = step.trl_old
        try:
            out = self._trace_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss
            )
        finally:
            if trl_old:
                step.reports = None
        if trl_old:
            step.trl_old_logps = out[0]
        pending = step.loss_inputs
        if pending is not None and batch_size is None:  # the forward of the loss `_compute_loss` is computing
            self._trace_state.loss_inputs = None
            self._trace_score_in_loss(pending, out[0])
        return out

    def _trace_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss
    ):
        """`_get_per_token_logps_and_entropies` itself: each forward in its hint context, packed or by row chunks."""
        step = self._trace_state
        rows = step.hint_rows()
        if rows is not None and len(rows) != input_ids.size(0):
            raise RuntimeError(
                f"TraceGRPOTrainer: {len(rows)} hint rows for a log-prob forward over {input_ids.size(0)} rows."
            )
        n = input_ids.size(0)
        keep_open = step.stack is not None and torch.is_grad_enabled()
        if self.token_budget is not None:
            # A loss forward (TRL passes no batch_size) keeps its micro-batch in one forward, so the loss, its
            # normalisation and the router aux loss see TRL's rows; scoring forwards take as many rows as fit.
            # "auto": the tokens of TRL's padded scoring micro-batch (batch_size rows of this width).
            if keep_open or batch_size is None:
                budget = None
            else:
                budget = batch_size * input_ids.size(1) if self.token_budget == "auto" else self.token_budget
            return self._packed_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, budget, rows, keep_open, compute_entropy,
                compute_aux_loss,
            )  # fmt: skip
        # A training forward keeps its context until backward: one chunk, so one set of hooks is installed.
        batch_size = n if keep_open else (batch_size or n)
        order, logps, entropies, aux = [], [], [], []
        for idx, lo, hi in _row_chunks(attention_mask, logits_to_keep, batch_size):
            mask = attention_mask[idx, lo:hi]
            cut = input_ids.size(1) - hi  # completion columns cut on the right: their log-probs are 0
            ctx = self._trace_forward(model, None if rows is None else rows[idx], mask)
            # The training forward's context goes on the step's stack (closed after backward); a scoring one closes here.
            with contextlib.ExitStack() as local:
                report = (step.stack if keep_open else local).enter_context(ctx)
                out = super()._get_per_token_logps_and_entropies(
                    model, input_ids[idx, lo:hi], mask, logits_to_keep - cut,
                    compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss,
                )  # fmt: skip
            if report is not None and keep_open:
                step.train_reports.append(report)
            if report is not None and step.reports is not None:
                step.reports.append(report)
            # The cut columns are completion padding, which TRL masks wherever it reads it.
            order.append(idx)
            logps.append(torch.nn.functional.pad(out[0], (0, cut)))
            entropies.append(None if out[1] is None else torch.nn.functional.pad(out[1], (0, cut)))
            aux.append(out[2])
        back = torch.argsort(torch.cat(order)).to(input_ids.device)  # each row back to its place
        return (
            torch.cat(logps, dim=0)[back],
            torch.cat(entropies, dim=0)[back] if compute_entropy else None,
            torch.stack(aux).mean() if compute_aux_loss else None,
        )

    def _packed_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, budget, rows, keep_open, compute_entropy,
        compute_aux_loss,
    ):  # fmt: skip
        """`_get_per_token_logps_and_entropies` padding-free (``token_budget``): the real tokens of a forward's rows
        are concatenated into one sequence [1, N], position ids restarting at 0 at each row, and no attention mask.

        The attention keeps the rows apart itself (`packing.packed_attention`: variable-length flash attention on CUDA
        in half precision, a causal sdpa per row elsewhere; no mask is built, and the FP4 K/V fake quantization still wraps it). The
        hints, recorded routes and token checks follow each row by (row, position) (`use_hints(packed=True)`); the FP4
        fake quantization of K/V and activations is per token (and head), so it sees the same values as padded. Only
        GEMM summation order can differ. The labels mark each row's completion tokens (whose predecessor is always in
        their row), and the results go back to TRL's [rows, logits_to_keep] layout, 0 at padding.

        ``budget``: the most real tokens one forward packs, rows in their order (on a Gated DeltaNet model, rows x
        the longest row: what its layers take padded); a row longer than it gets a forward of its own, never
        dropped; None packs all rows into one forward.
        """
        step = self._trace_state
        mask = attention_mask.bool()
        width = input_ids.size(1)
        labels = input_ids.masked_fill(~mask, -100)
        labels[:, : width - logits_to_keep] = -100
        logps, entropies, aux = [], [], []
        for lo, hi in token_chunks(mask.sum(1).tolist(), budget, padded=self.packs_padded_rows):
            m = mask[lo:hi]
            positions = (m.long().cumsum(1) - 1)[m].unsqueeze(0)
            extra = {"output_router_logits": True} if compute_aux_loss else {}
            ctx = self._trace_forward(model, None if rows is None else rows[lo:hi], attention_mask[lo:hi], packed=True)
            # The training forward's context goes on the step's stack (closed after backward); a scoring one closes here.
            with contextlib.ExitStack() as local:
                report = (step.stack if keep_open else local).enter_context(ctx)
                with self.accelerator.autocast():
                    out = model(
                        input_ids=input_ids[lo:hi][m].unsqueeze(0), position_ids=positions,
                        labels=labels[lo:hi][m].unsqueeze(0), fused_lm_head=True, **extra,
                    )  # fmt: skip
            if report is not None and keep_open:
                step.train_reports.append(report)
            if report is not None and step.reports is not None:
                step.reports.append(report)
            logps.append(unpack(out.log_probs, m)[:, width - logits_to_keep :])
            if compute_entropy:
                entropies.append(unpack(out.entropy, m)[:, width - logits_to_keep :])
            aux.append(out.aux_loss)
        return (
            torch.cat(logps),
            torch.cat(entropies) if compute_entropy else None,
            torch.stack(aux).mean() if compute_aux_loss else None,
        )

    def training_step(self, model, inputs, num_items_in_batch):
        # Backward runs inside Trainer.training_step; the hint context entered by the training forward stays open
        # until it returns, so checkpointed layers recompute with the same hints and routing.
        step = self._trace_state
        step.train_reports, scored = [], step.scored
        with contextlib.ExitStack() as stack:
            step.stack = stack
            try:
                loss = super().training_step(model, inputs, num_items_in_batch)
            finally:
                step.stack = None
        if step.scored is not scored:  # skip_scoring_forward: this loss forward scored its rows; `log` logs them
            step.scored_reports.extend(step.train_reports)
        if self.args.trace_metrics and self._trace_replays:
            self._trace_log_train_reports(step.train_reports)
        step.train_reports = []
        return loss

    def _trace_log_train_reports(self, reports: list[MismatchReport]) -> None:
        """What the hints corrected in the gradient forward itself (after TRL's shuffle and split): a live check
        that every row met its own hints (misaligned hints would disagree with nearest rounding about half the time).
        """
        report = MismatchReport.merged(reports)
        sums = {
            "flips": report.total_flips,
            "elements": report.total_elements,
            "routing_diff": int(report.routing_diff),
            "routing_total": report.routing_total,
        }
        s = reduce_sums(self.accelerator, sums)
        log_ratio(self._metrics["train"], "trace/train/hint_flip_rate", s["flips"], s["elements"])
        log_ratio(self._metrics["train"], "trace/train/routing_mismatch", s["routing_diff"], s["routing_total"])

    def _compute_loss(self, model, inputs):
        keys = HintBatch.input_keys(HINT_PREFIX)
        if self._trace_replays and all(k in inputs for k in keys):
            self._trace_state.rows = HintBatch.from_inputs(inputs, self._fmt, self._hint_layers, HINT_PREFIX)
        ratio = inputs.get("importance_sampling_ratio")
        if self._scores_in_loss(inputs):
            # Completed by the loss forward with the ratio from its own log-probs (`_trace_score_in_loss`).
            inputs = self._trace_state.loss_inputs = dict(inputs)
        elif ratio is not None and self.loss_type != "vespo":
            inputs = {**inputs, "advantages": _times_ratio(inputs["advantages"], ratio)}
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._trace_state.rows = self._trace_state.loss_inputs = None

    def _scores_in_loss(self, batch: dict) -> bool:
        """Whether the IS ratio and the rollout's metrics come from the training forward (`skip_scoring_forward`):
        in training, where TRL keeps no old log-probs for ``batch`` (a generation batch, or a micro-batch of one),
        since the policy cannot change between its rollout and its training forwards. Hints recorded only to be
        measured (no hints or replay applied) reach the scoring forward alone, which then still runs."""
        a = self.args
        return (
            a.skip_scoring_forward
            and self.model.training
            and "old_per_token_logps" not in batch
            and (a.rollout_importance_sampling or a.trace_metrics)
            and (self._trace_replays or not self._trace_records)
        )

    def _trace_score_in_loss(self, inputs: dict, logps: torch.Tensor) -> None:
        """The scoring forward's products from the loss forward's log-probs (detached): the IS ratio, applied to
        ``inputs`` as `_compute_loss` applies a scored one, and the metrics' sums, which `log` logs."""
        a = self.args
        old, sampling = logps.detach(), inputs["sampling_per_token_logps"]
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        ratio = None
        if a.rollout_importance_sampling:
            ratio = importance_sampling_ratio(
                old, sampling, mask, a.rollout_importance_sampling_mode, a.rollout_importance_sampling_clip_min,
                a.rollout_importance_sampling_clip_max,
            )  # fmt: skip
            inputs["importance_sampling_ratio"] = ratio
            if self.loss_type != "vespo":
                inputs["advantages"] = _times_ratio(inputs["advantages"], ratio)
        if a.trace_metrics:
            step = self._trace_state
            step.scored = _add_sums(step.scored, _scored_sums(old, sampling, mask, ratio))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        step = self._trace_state
        if step.scored is not None:  # skip_scoring_forward: the loss forwards' rollout metrics since the last log
            self._trace_log_metrics("train", step.scored, step.scored_reports)
            step.scored, step.scored_reports = None, []
        super().log(logs, start_time)


def _scored_sums(old, sampling, mask, ratio) -> dict[str, torch.Tensor]:
    """The rollout metrics' sums over a scored batch's completion tokens that have a sampler log-prob, as device
    scalars, so that each training forward adds its own without waiting for the GPU: the trainer - sampler log-prob
    difference (sum of |d|, count, KL estimator, max |d|) and, with ``ratio``, the IS ratios (sum, count, min, max;
    one a token, or one a row in the sequence modes)."""
    m = mask.bool() & ~torch.isnan(sampling)
    d = torch.where(m, old - sampling, 0.0)
    zero = d.new_zeros(())
    sums = {
        "logp_diff": d.abs().sum(),
        "tokens": m.sum(),
        "kl": (torch.expm1(d) - d).sum(),  # KL(sampler || trainer) estimator on the sampler's own tokens
        "logp_diff_max": d.abs().amax() if d.numel() else zero,
    }
    if ratio is not None:
        counted = torch.ones_like(ratio, dtype=torch.bool) if ratio.size(-1) == 1 else m
        sums |= {
            "ratio": torch.where(counted, ratio, 0.0).sum(),
            "ratio_n": counted.sum(),
            "ratio_min": torch.where(counted, ratio, math.inf).amin() if ratio.numel() else zero + math.inf,
            "ratio_max": torch.where(counted, ratio, -math.inf).amax() if ratio.numel() else zero - math.inf,
        }
    return sums


def _add_sums(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Two `_scored_sums` as one: sums and counts added, extremes kept."""
    if a is None:
        return b
    pick = {"logp_diff_max": torch.maximum, "ratio_max": torch.maximum, "ratio_min": torch.minimum}
    return {k: pick.get(k, torch.add)(a[k], b[k]) for k in b}


def _times_ratio(advantages: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """Per-token advantages times the IS ratio: per_token_loss * r equals the loss computed with advantages * r for
    every TRL loss here (r >= 0 keeps the sign that clipping looks at), and TRL accepts [B, T] advantages from
    subclasses; VESPO reads the ratio itself."""
    return (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages) * ratio


def _row_chunks(attention_mask: torch.Tensor, logits_to_keep: int, batch_size: int) -> list:
    """The forwards of a log-prob pass: (rows, lo, hi) each, a CPU tensor of row ids and the columns [lo, hi) where one
    of those rows has a real token.

    TRL pads every completion to the longest of the generation batch, and with long-tailed lengths most of a batch is
    padding (at 64 x 8K, 7 columns in 8). Each forward also costs a fixed setup at full depth (about 0.2-0.4 s at 48
    layers on the H200, whatever its length). So rows go into forwards by length, shortest first, as many to a
    forward as fit the tokens ``batch_size`` full-width rows would take: short rows share one forward, a long row
    has its own, and no forward is larger than before. Left padding is cut only inside the prompt and right padding
    only inside the completion. A row's values do not depend on its forward (attention is causal and position ids
    come from the mask), except for the last bits of kernels whose summation order follows their shapes. One host
    sync."""
    n, width = attention_mask.shape
    cols = torch.arange(width, device=attention_mask.device)
    real = attention_mask.bool()
    first, last = torch.where(real, cols, width).amin(1), torch.where(real, cols, -1).amax(1)
    spans = []
    for lo, hi in torch.stack([first, last], 1).tolist():
        lo, hi = (0, width - 1) if hi < 0 else (lo, hi)  # a row of padding only: nothing to cut by
        spans.append((max(0, min(lo, width - logits_to_keep - 1)), max(hi + 1, width - logits_to_keep + 1)))
    budget = batch_size * width
    chunks, rows, lo, hi = [], [], width, 0
    for r in sorted(range(n), key=lambda r: spans[r][1] - spans[r][0]):  # stable: equal spans keep their order
        lo2, hi2 = min(lo, spans[r][0]), max(hi, spans[r][1])
        if rows and (len(rows) + 1) * (hi2 - lo2) > budget:
            chunks.append((rows, lo, hi))
            rows, lo2, hi2 = [], spans[r][0], spans[r][1]
        rows, lo, hi = rows + [r], lo2, hi2
    chunks.append((rows, lo, hi))
    return [(torch.tensor(sorted(c)), lo, hi) for c, lo, hi in chunks]  # CPU row ids index hints wherever they are


def _check_peft_targets(model, peft_config) -> None:
    """A list of target_modules that names a module the model lacks is a typo, not a wish to skip it: PEFT wraps
    the names that match and says nothing of the others. On a `PeftModel` the user wrapped, the names are its base
    model's, without the adapters' own modules (`lora_A`, `base_layer`)."""
    targets = getattr(peft_config, "target_modules", None)
    if not isinstance(targets, (list, tuple, set)) or getattr(peft_config, "target_parameters", None):
        return  # a regex or "all-linear" is PEFT's to match; with target_parameters PEFT may match modules differently
    if is_peft_model(model):
        model = model.get_base_model()
    names = {}  # module name -> whether it is (or wraps) a Linear
    for n, m in model.named_modules():
        if n and ".lora_" not in n:
            key = n.removesuffix(".base_layer")
            names[key] = names.get(key, False) or isinstance(m, torch.nn.Linear)
    missing = sorted(t for t in targets if not any(n == t or n.endswith("." + t) for n in names))
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, linear in names.items() if linear})
        raise ValueError(
            f"The PEFT config's target_modules {missing} name no module of {type(model).__name__}; its linear layers "
            f"are {leaves}. For LoRA on the attention use target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']."
        )


def _check_peft(model, peft_config) -> None:
    """Refuse adapters on the FP4 experts: the packed rollout weights are quantized from the base parameters only."""
    if peft_config is None or not isinstance(model, torch.nn.Module):
        return
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
