# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`TraceGRPOConfig`: TRL's `GRPOConfig` plus the TRACE options (kept apart from the trainer, as TRL keeps
`grpo_config.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from ..rollout import ROLLOUT_ENGINES
from .delta_rule import GATED_DELTA_RULES
from .grouping import check_sampling_strategy
from .importance import IS_MODES
from .trl_options import check_trl_options


# TRL's vLLM importance-sampling fields and their counterparts here (same meaning, applied to the FP4 sampler).
_TRL_IS_FIELDS = (
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
)
ROLLOUT_PRECISIONS = ("fp4", "bf16")
# The TRACE fields checked by type, not only by value: a string such as "false" is truthy, so a bool field given
# one would stay on, and a string or float count fails far from the config (or only on the GPU path).
_BOOL_FIELDS = (
    "rollout_compaction",
    "rollout_share_prefill",
    "trace_hints",
    "routing_replay",
    "rollout_importance_sampling",
    "trace_metrics",
    "fused_rms_norm",
    "fused_rope",
    "disable_input_dtype_casting",
    "skip_scoring_forward",
)
_FLOAT_FIELDS = (  # int accepted, bool not; the optional ones take None
    "rollout_free_memory_fraction",
    "rollout_importance_sampling_clip_max",
    "rollout_importance_sampling_clip_min",
)


def _check_types(config) -> None:
    """Refuse TRACE fields of the wrong type by name, before any value check compares them."""
    for name in _BOOL_FIELDS:
        value = getattr(config, name)
        if not isinstance(value, bool):
            raise ValueError(
                f"TraceGRPOConfig.{name}={value!r}: give True or False (a string such as 'false' is truthy and would "
                "leave the option on)."
            )
    for name in _FLOAT_FIELDS:
        value = getattr(config, name)
        optional = name != "rollout_free_memory_fraction"
        if (value is None and optional) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            continue
        raise ValueError(
            f"TraceGRPOConfig.{name}={value!r}: give a number (int or float, not a string or bool)"
            + (", or None." if optional else ".")
        )
    rows = config.rollout_max_rows
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int)):
        raise ValueError(
            f"TraceGRPOConfig.rollout_max_rows={rows!r}: give an int number of rows >= 1 (not a bool), or None for as "
            "many as fit."
        )


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
            (Qwen3 MoE and Qwen3.5 MoE, hybrid Gated DeltaNet layers included; FP4 or BF16). `"generate"`:
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
            With the rollout engine, `"cpu"` also streams the decode steps' records to CPU memory during the rollout
            (every `EngineRollout.record_window` steps), so at long context more rows fit a wave (docs/api.md).

        gated_delta_rule (`str`, *optional*, defaults to `"auto"`):
            How training-side forwards compute the gated delta rule of Gated DeltaNet layers (Qwen3.5, Qwen3-Next).
            `"recurrent"`: the recurrent form's values (what the rollout's decode steps compute); on CUDA with the
            recurrence's own gradient from a backward kernel, elsewhere the chunked form's; on a warmed Qwen3.5 MoE this removed most of the BF16 rollout/training KL
            (docs/results.md section 7), and at 8 layers on an H100 it was 1.13x faster than `"chunk"` on the same
            rollout with 2.7x less KL (docs/benchmarks.md). On CUDA the recurrent values take one kernel launch per
            layer call (`trace_hf.kernels.gated_delta_recurrent`); elsewhere transformers' loop of one step per
            token. `"chunk"`: transformers' chunked form. `"auto"`: `"recurrent"` on models with Gated DeltaNet
            layers; models without them have nothing to choose (`"recurrent"` is refused there).
        token_budget (`int`, *optional*):
            Padding-free packed training-side forwards (TRL's name, from its async GRPO trainer): the real tokens of
            a forward's rows go into one sequence, position ids restarting at each row, so no padding is computed.
            A scoring forward (old and reference log-probs) packs rows, in order, up to `token_budget` real tokens
            (a row longer than that gets a forward of its own, never dropped); a training forward packs exactly
            TRL's micro-batch (`per_device_train_batch_size` rows), so the loss and its normalisation are TRL's.
            `None` (default): packed wherever the packed forward keeps the rows apart (Qwen3 MoE and Qwen3.5 MoE, both
            measured faster packed), each scoring forward holding the tokens of TRL's padded one; Gated DeltaNet
            layers (Qwen3.5) take the packed rows right-padded, so there a scoring forward's budget counts rows x
            the longest row. `0` (or less):
            TRL's padded row micro-batches (each cut to the columns its rows use). A budget on a model whose
            attention cannot keep packed rows apart (sliding windows, other implementations) is refused.

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
        skip_scoring_forward (`bool`, *optional*, defaults to `True`):
            Where TRL itself takes the old log-probs from the training forward (its `old_per_token_logps` is `None`:
            `num_iterations=1` and `gradient_accumulation_steps` a multiple of `steps_per_generation`, so the policy
            cannot change between a rollout and the training forwards of its rows), take the trainer's log-probs for
            the IS ratio and the rollout's `trace/*` metrics from each training forward too (detached), instead of
            from a separate no-grad scoring forward over the whole generation batch: one training-side forward
            fewer per row. The rows, hints and routing are the same; the log-probs differ only by the forwards'
            summation order. The metrics are then taken over the tokens of every training forward since the last
            log (one generation batch when each optimizer step is logged, as with a scoring forward). Evaluation,
            runs where TRL keeps old log-probs, and hints recorded only to be measured (`trace_hints=False`,
            `routing_replay=False`) score as before. `False`: always run the scoring forward.

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
            "help": "'engine': the CUDA-graph decode engine (Qwen3 MoE and Qwen3.5 MoE); 'generate': model.generate "
            "(any MoE); 'auto': the engine on CUDA when the model is supported, else generate.",
            "choices": list(ROLLOUT_ENGINES),
        },
    )
    rollout_max_rows: int | None = field(
        default=None,
        metadata={
            "help": "Rollout engine: at most this many rows decode at once; a larger generation batch runs in equal "
            "waves. None: as many as fit in free GPU memory (the FP4 KV cache fits several times more than BF16)."
        },
    )
    rollout_free_memory_fraction: float = field(
        default=0.9,
        metadata={
            "help": "Rollout engine: the share of the GPU's free memory (after weights, optimizer state and "
            "activations) its decode state may take when it admits rows. Not vLLM's gpu_memory_utilization, which "
            "is a share of all memory."
        },
    )
    rollout_compaction: bool = field(
        default=True,
        metadata={
            "help": "Rollout engine: when the rows of a wave still decoding fit a smaller row bucket, move them to "
            "the front and decode on in that bucket (the long tail of completion lengths then stops costing full "
            "batches). The same tokens, log-probs and records; False decodes every wave in its bucket to the end."
        },
    )
    rollout_share_prefill: bool = field(
        default=True,
        metadata={
            "help": "Rollout engine: prefill each distinct prompt of a wave once and give its KV cache, first-token "
            "logits and prompt hints to all its num_generations rows. The same tokens, log-probs and records (rows "
            "still sample independently); False prefills every row."
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
            "help": "Where recorded hints live until training: 'device' or 'cpu' (the engine then streams its decode "
            "records to CPU memory during the rollout, so at long context more rows fit a wave).",
            "choices": ["device", "cpu"],
        },
    )
    gated_delta_rule: str = field(
        default="auto",
        metadata={
            "help": "Gated DeltaNet (Qwen3.5) in training forwards: 'recurrent' (the rollout's recurrent values: less "
            "rollout/training mismatch; on CUDA one kernel over the sequence each way, the recurrence's own gradient; "
            "elsewhere one step per token, the chunked form's gradient), 'chunk' (transformers' chunked form), or "
            "'auto' (recurrent where the model has Gated DeltaNet layers).",
            "choices": list(GATED_DELTA_RULES),
        },
    )
    token_budget: int | None = field(
        default=None,
        metadata={
            "help": "Pack training-side forwards padding-free: scoring forwards take rows up to this many real "
            "tokens (a longer row runs alone, never dropped), training forwards their whole micro-batch. None: packed "
            "wherever rows stay apart (Qwen3 MoE, Qwen3.5 MoE), the padded forwards' tokens; 0: TRL's padded micro-batches."
        },
    )
    fused_rms_norm: bool = field(
        default=True,
        metadata={
            "help": "Run the model's RMSNorms (transformers' Qwen3 MoE, Qwen3.5 MoE and other known classes) as one "
            "Triton launch forward and one backward on CUDA instead of ~20 elementwise launches: values differ from "
            "transformers' only by the fp32 order of the sum of squares. CPU forwards keep transformers' ops."
        },
    )
    fused_rope: bool = field(
        default=True,
        metadata={
            "help": "Run the attention's rotary embedding (transformers' apply_rotary_pos_emb of Qwen3 MoE, Qwen3.5 "
            "MoE and other known models) as one Triton launch forward and one backward on CUDA in training-side "
            "forwards: transformers' values bit for bit, fewer launches and passes."
        },
    )
    disable_input_dtype_casting: bool = field(
        default=True,
        metadata={
            "help": "Under autocast (bf16=True or fp16=True), feed PEFT's LoRA adapters their input as it is instead "
            "of cast to the adapters' dtype (fp32 by PEFT's default) first, as peft.helpers.disable_input_dtype_casting "
            "does, on the adapters where it changes no value (plain LoRA without dropout): autocast casts the copy back "
            "for the adapter's matmul, so every value is the same and each adapter makes four [tokens, in_features] "
            "copies fewer per forward and backward. No effect without autocast."
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
    skip_scoring_forward: bool = field(
        default=True,
        metadata={
            "help": "Where TRL takes the old log-probs from the training forward (num_iterations=1, one optimizer "
            "step per generation batch), take the IS ratio and the rollout's trace/* metrics from each training "
            "forward too, instead of a separate no-grad scoring forward: one training-side forward fewer per row. "
            "Metrics then cover the training forwards since the last log. False: always run the scoring forward."
        },
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
        check_trl_options(self)  # TRL options this trainer cannot honour (trace_hf.train.trl_options)
        check_sampling_strategy(self)  # group_by_length: micro-batches by length (trace_hf.train.grouping)
        _check_types(self)
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
        if self.rollout_max_rows is not None and self.rollout_max_rows < 1:
            raise ValueError(
                f"TraceGRPOConfig.rollout_max_rows={self.rollout_max_rows}: use None (as many rows as fit) or at least 1."
            )
        if not 0 < self.rollout_free_memory_fraction <= 1:
            raise ValueError(
                f"TraceGRPOConfig.rollout_free_memory_fraction={self.rollout_free_memory_fraction}: use a share in (0, 1]."
            )
        if self.rollout_precision == "bf16" and (self.trace_hints or self.routing_replay):
            raise ValueError(
                "rollout_precision='bf16' rolls out without FP4, so there are no hints or recorded routing to replay: "
                "set trace_hints=False and routing_replay=False."
            )
        if self.gated_delta_rule not in GATED_DELTA_RULES:
            raise ValueError(
                f"TraceGRPOConfig.gated_delta_rule={self.gated_delta_rule!r}: use one of {list(GATED_DELTA_RULES)}."
            )
        if self.trace_hint_storage not in ("device", "cpu"):
            raise ValueError(f"TraceGRPOConfig.trace_hint_storage={self.trace_hint_storage!r}: use 'device' or 'cpu'.")
        budget = self.token_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
            raise ValueError(
                f"TraceGRPOConfig.token_budget={budget!r}: give an int number of tokens to pack forwards, 0 for TRL's "
                "padded row micro-batches, or None (packed where exact)."
            )
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
