# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The rollout engine: batched prefill, then sampling decode steps replayed from a CUDA graph.

Why: `model.generate` spends more time per token in Python and kernel launches than an FP4 decode step of an MoE
model takes on the GPU, which hides everything FP4 saves. The engine keeps generate's function and the
`RolloutOutput` contract, and changes how it runs:

* prefill: one forward of the transformers model over the left-padded prompts (eval mode: FP4 experts, the FP4 or
  BF16 KV cache, a `HintRecorder` for the prompt's hints), keeping only the last position's logits; its K/V are
  copied, left padding removed, into the static cache of `FastDecoder`. Each distinct prompt of a wave is prefilled
  once (GRPO repeats every prompt ``num_generations`` times) and its cache, logits and prompt hints go to every row
  that has it (``share_prefill``);
* decode: `FastDecoder.step` (the model's own parameters and packed FP4 experts, fixed kernels, static buffers)
  followed by the sampler (`trace_hf.rollout.sampling`), the per-row EOS stop and the hint/routing records, all
  inside one step that a CUDA graph captures once per (batch, length, sampling) bucket and replays;
* stop: rows that emit an EOS id stop (their later tokens are padding); the loop ends at max_new_tokens or once
  every row has stopped (checked every few steps, the only host synchronization);
* admission: as many rows decode at once as fit, and a rollout of more rows runs in equal waves, one after the
  other, in one bucket: planned before the wave runs (`trace_hf.rollout.engine.planner`);
* compaction (the long tail): a wave decodes until its longest row stops. Whenever the rows still needed fit a
  smaller bucket (checked every ``check_every`` steps, at the stop check's one synchronization), the engine swaps
  them into the first rows (K/V caches, linear-attention states, positions, input tokens, stop and sampler state:
  one gather of the moved rows per buffer) and steps on in that bucket's graph, captured up front on views of the
  same buffers (no memory of its own). A stopped row is still needed for one step, the one that feeds its EOS (so
  that its last token's records exist, as without compaction). Outputs and records stay at the row's own index
  (`Runner.row_ids`), and the sampler keys its noise by that row, not by where the row decodes, so compaction
  changes no record and no draw (up to the summation order of products over fewer rows: cuBLAS, or the CPU's BLAS,
  may sum a row otherwise in a smaller batch). `EngineStats` counts the row-steps decoded, the compactions and each
  wave's buckets.

The parts, nano-vllm's: the planner decides the waves (`planner`), a `Runner` holds one bucket's buffers, graph and
sampler state (`runner`), and `EngineRollout` here runs each wave: prefill, cache load, the decode loop (`_decode`).

Before every rollout the engine refreshes what it reads from the model (`trace_hf.rollout.engine.weights`): packed
FP4 experts are re-quantized from the masters in place (`TraceFP4Experts.refresh_packed`), every tensor it derives
(fused projections, LoRA-folded weights, offset norms) is recomputed in place, and any parameter whose storage moved
(reloaded) rebuilds the weights and drops the graphs. So the engine sees every update, however it was made. What it
reads, and which decoder steps it, is the model family's entry in `trace_hf.rollout.engine.layouts` (Qwen3 MoE:
`FastDecoder`; Qwen3.5 MoE: `HybridDecoder`). Under FSDP2 the engine owns full copies of what it reads, refreshed by
gathering one layer at a time (`ShardedWeights`). On CPU it runs eagerly through the Triton interpreter (tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ...hints import HintRecorder
from ...quant.experts import fp4_experts
from ...quant.freshness import no_prefill_refresh
from ...quant.kv_cache import FP4KVLayer, fp4_cache
from ..base import RolloutOutput, causal_lm, cut_after_eos, left_pad, to_lists, vocab_size_of
from ..generate import check_sampling
from ..sampling import SamplingSettings
from .decoder import FastDecoder
from .kernels import kernels
from .layouts import layout_of
from .planner import WavePlan, cache_length, distinct_prompts, free_bytes, memory_budget, plan_waves
from .recording import cat_hints
from .runner import RowBytes, Runner, bytes_per_row, row_bucket
from .support import kv_format, unsupported_reason
from .weights import DecodeWeights, EngineWeights, ShardedWeights, engine_weights


#: `EngineRollout._load_cache` copies each FP4 KV layer's six fields (codes, block and row scales of K and V) in one
#: Triton launch (`decode_ops.load_fp4_kv`) instead of twelve torch ones (a gather and a copy per field), the same
#: bits. At a 16K-token prefill the FP4 load took 17.5 ms against BF16's 6.7, its launches' time; with it
#: 1.8 ms (docs/lab-notes.md 11).
LOAD_KV_KERNEL = True


def _cache_kwarg(lm) -> str:
    """transformers renamed the forward's cache argument `past_key_values` -> `cache` (5.2x)."""
    import inspect

    return "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"


@dataclass
class EngineStats:
    """What the last rollout ran: its waves (all of ``rows_per_wave`` rows but the last, in buckets of
    ``bucket_rows``), the decode steps of each (with the prefill's token) and each row's kept tokens.

    The long tail's cost: each wave runs until its longest row stops, and a stopped row's slot decodes padding until
    then or until a compaction moves the live rows into a smaller bucket. ``row_steps`` counts the row-steps the
    buckets decoded (the prefill's token one step of the wave's bucket), ``compactions`` the moves, ``buckets`` each
    wave's (decode step, bucket rows) from its start and each compaction on; ``slot_occupancy`` is the kept tokens
    over the row-steps. ``prefill_rows``: the rows the prefills ran, over all waves (with ``share_prefill``, each
    wave's distinct prompts; else every row)."""

    rows: int
    waves: int
    rows_per_wave: int
    bucket_rows: int
    steps: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    row_steps: int = 0
    compactions: int = 0
    prefill_rows: int = 0
    buckets: list[list[tuple[int, int]]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def slot_occupancy(self) -> float:
        return self.tokens / max(1, self.row_steps)

    @property
    def padding_row_steps(self) -> int:
        """Row-steps that decoded padding for a row that had stopped."""
        return self.row_steps - self.tokens


class EngineRollout:
    """Rolls out through the engine (see the module docstring). Keeps the decoders of the last ``max_buckets``
    (rows, length, sampling) buckets, with their graphs, across calls.

    It decodes as many rows at once as fit: one row takes `bytes_per_row` (its KV cache, FP4 or in the model dtype,
    sampler and record buffers, and the prefill's cache of each prompt the wave prefills), and a rollout of more rows
    than fit runs in waves of equal size (see `EngineStats` for what the waves and the long tail of lengths cost).

    Args:
        max_buckets: decoders (KV caches and graphs) kept alive at once.
        length_bucket: cache lengths are rounded up to a multiple of this, so prompts of other lengths reuse a
            graph.
        check_every: decode steps between checks that every row has stopped (each check synchronizes).
        use_graphs: capture the decode step in a CUDA graph (default: on CUDA).
        max_rows: most rows decoded at once, one wave (None: as many as fit).
        free_memory_fraction: the share of the device memory free at the rollout (what the engine's own cached
            buckets hold counted as free) that one wave's rows may take; the rest is the prefill's activations'.
            Not vLLM's ``gpu_memory_utilization`` (a share of all device memory, weights included): the model's
            weights are already resident here, and training needs what the rollout leaves.
        memory_limit: bytes one wave's rows may take, instead of that share (also on CPU, where nothing is
            measured and rows are otherwise unlimited).
        compaction: when a wave's rows still decoding fit a smaller bucket, move them to the front and step on in
            that bucket (see the module docstring; costs a graph capture per smaller bucket once, and a gather of
            the moved rows' caches per compaction). Off: every wave decodes in its bucket to the end.
        record_window: with hints kept in CPU memory (``storage="cpu"``, `TraceGRPOConfig.trace_hint_storage`), the
            decode steps' records leave the device every this many steps (`StepRecords.flush`: one synchronizing
            copy), so a row holds this many steps of them on the device instead of its whole completion's: at 128K
            on Qwen3.5-35B-A3B, 16 MiB a row instead of 1.03 GiB, so more rows fit a wave. Completions no longer
            than this keep their records on the device until the wave ends either way.
        share_prefill: prefill each distinct prompt of a wave once and give its KV cache (and linear-attention
            states), first-token logits and prompt hints to every row with that prompt (GRPO's ``num_generations``
            copies). Changes nothing but the prefill's time and memory, so more rows fit a wave (up to the
            summation order of the prefill's products over fewer rows, as with compaction): rows with the same
            prompt still sample independently (the sampler keys its noise by row). Off: every row is prefilled.
    """

    name = "engine"

    def __init__(self, max_buckets: int = 2, length_bucket: int = 256, check_every: int = 8, use_graphs=None,
                 max_rows: int | None = None, free_memory_fraction: float = 0.9,
                 memory_limit: int | None = None, compaction: bool = True, share_prefill: bool = True,
                 record_window: int = 2048):  # fmt: skip
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows={max_rows}: use None (as many as fit) or at least 1.")
        if record_window < 1:
            raise ValueError(f"record_window={record_window}: use at least 1 decode step.")
        if not 0 < free_memory_fraction <= 1:
            raise ValueError(f"free_memory_fraction={free_memory_fraction}: use a share in (0, 1].")
        self.max_buckets, self.length_bucket, self.check_every = max_buckets, length_bucket, check_every
        self.use_graphs = use_graphs
        self.max_rows, self.free_memory_fraction, self.memory_limit = max_rows, free_memory_fraction, memory_limit
        self.compaction, self.share_prefill, self.record_window = compaction, share_prefill, record_window
        self.stats: EngineStats | None = None
        self._model = None
        self._weights: EngineWeights | ShardedWeights | None = None
        self._runners: OrderedDict = OrderedDict()

    # -- weights, admission and buckets -------------------------------------------------------------------------

    def _weights_for(self, lm) -> DecodeWeights:
        if self._model is not lm:
            self._runners.clear()
            self._weights, self._model = engine_weights(lm, layout_of(lm.config)), lm
        elif not self._weights.refresh():
            self._runners.clear()
        return self._weights.w

    def _waves(self, prompt_ids, per_row: RowBytes, prompt_len: int, max_new: int, dev) -> WavePlan:
        """The waves of a rollout of ``prompt_ids`` under this engine's memory knobs (`planner.plan_waves`). Raises
        only when a single row does not fit."""
        cached = sum(r.nbytes for r in self._runners.values())
        budget = memory_budget(dev, self.memory_limit, self.free_memory_fraction, cached)
        if budget is not None and budget < per_row.total:
            knob = "memory_limit" if self.memory_limit is not None else "free_memory_fraction"
            raise torch.OutOfMemoryError(
                f"The rollout engine cannot fit one row of {prompt_len} prompt + {max_new} completion tokens: it "
                f"takes about {per_row.total / 2**20:.1f} MiB (KV cache, prefill cache, sampler and record buffers) "
                f"and EngineRollout({knob}={getattr(self, knob)}) allows {budget / 2**20:.1f} MiB. Raise {knob} (or "
                "free device memory), or lower max_completion_length / max_prompt_length."
            )
        return plan_waves(prompt_ids, per_row, budget, self.max_rows, self.share_prefill, dev.type == "cuda")

    def _runner(self, w: DecodeWeights, batch: int, length: int, s: SamplingSettings, kv_fp4: bool, record: bool,
                window: int | None, per_row: RowBytes, need: int):  # fmt: skip
        """The runner of this bucket, built (after evicting the oldest ones while ``need``, the wave's bytes, does not
        fit) or reused. ``window``: the steps of records it keeps on the device (None: all)."""
        key = (batch, length, s.key(), s.max_new_tokens, kv_fp4, record, window, self.compaction)
        if key in self._runners:
            self._runners.move_to_end(key)
            return self._runners[key]
        dev = w.embed.device
        while len(self._runners) >= self.max_buckets or (self._runners and dev.type == "cuda"
                                                          and need > free_bytes(dev)):  # fmt: skip
            self._runners.popitem(last=False)
            if dev.type == "cuda":
                gc.collect()  # a runner and its decoder refer to each other: free its cache and graph now
        if dev.type == "cuda" and need > torch.cuda.mem_get_info(dev)[0]:
            # Admission counted torch's cached-but-unused blocks as free; handed back to the driver, they serve the
            # bucket's large buffers whole instead of failing on fragments (a 128K Qwen3.5 bucket ran out of memory
            # with 18 GB reserved and unallocated).
            torch.cuda.empty_cache()
        try:
            runner = Runner(w, batch, length, s, kv_fp4, record, self._weights.layout.decoder, self.compaction, window)
            graphs = dev.type == "cuda" if self.use_graphs is None else self.use_graphs
            if graphs and s.max_new_tokens > 3:
                runner.capture()
        except torch.OutOfMemoryError as e:
            self._runners.clear()
            raise torch.OutOfMemoryError(
                f"The rollout engine could not allocate a bucket of {batch} rows x {length} tokens (KV cache, logits "
                "and graph buffers) although its estimate fit. Lower EngineRollout(free_memory_fraction=...) or "
                "max_rows, or max_completion_length / max_prompt_length."
            ) from e
        runner.nbytes = batch * per_row.decode  # what it keeps: the prefill's cache is gone after each wave
        self._runners[key] = runner
        return runner

    # -- rollout ------------------------------------------------------------------------------------------------

    def __call__(self, model, prompt_ids, generation_config, record: bool = False, storage: str = "device"):
        check_sampling(generation_config)
        reason = unsupported_reason(model, require_cuda=False)
        if reason is not None:
            raise ValueError(
                f"The rollout engine cannot roll out this model: {reason}. Use rollout_engine='generate'."
            )
        s = SamplingSettings.from_generation_config(generation_config)
        if s.seed is None:
            s = SamplingSettings(**{**s.__dict__, "seed": int(torch.randint(0, 2**62, (1,)).item())})
        lm = causal_lm(model)
        if lm.training:
            raise RuntimeError("The rollout engine runs the eval (rollout) path: call model.eval() first.")
        start = time.perf_counter()
        with torch.no_grad():
            out = self._rollout(lm, prompt_ids, s, record and bool(fp4_experts(lm)), storage)
        out.seconds = time.perf_counter() - start
        return out

    def _rollout(self, lm, prompt_ids, s: SamplingSettings, record: bool, storage: str) -> RolloutOutput:
        w = self._weights_for(lm)
        dev = w.embed.device
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("A rollout needs at least one prompt, each of at least one token.")
        # One left-pad width for every wave, so each wave's rows are laid out as in one batch of all of them.
        P = max(len(p) for p in prompt_ids)
        length = cache_length(P + s.max_new_tokens, self.length_bucket if dev.type == "cuda" else 1)
        kv_fp4 = kv_format(lm) is not None
        window = self.record_window if record and storage == "cpu" and self.record_window < s.max_new_tokens else None
        per_row = bytes_per_row(w, length, P, s, kv_fp4, record, window)
        wave, batch, need = self._waves(prompt_ids, per_row, P, s.max_new_tokens, dev)
        self.stats = EngineStats(len(prompt_ids), -(-len(prompt_ids) // wave), wave, batch)
        ids, lps, hints = [], [], []
        for k, a in enumerate(range(0, len(prompt_ids), wave)):
            # Wave k draws with seed + k: its rows' draws are independent of the other waves' rows of the same slots.
            sk = s if k == 0 else dataclasses.replace(s, seed=s.seed + k)
            r = self._runner(w, batch, length, sk, kv_fp4, record, window, per_row, need)
            c, lp, h = self._wave(lm, r, prompt_ids[a : a + wave], P, sk, record, dev)
            ids += c
            lps += lp
            hints += [h] if h is not None else []
        self.stats.lengths = [len(c) for c in ids]
        out_hints = None
        if record:
            out_hints = cat_hints(hints)
            if storage == "cpu":
                out_hints = out_hints.to("cpu")
        return RolloutOutput(ids, lps, out_hints, self.name)

    def _wave(self, lm, r: Runner, prompt_ids, P: int, s: SamplingSettings, record: bool, dev):
        """Prefill and decode one wave of rows in runner ``r``: (completion ids, log-probs, hints or None)."""
        dec = r.dec
        B = len(prompt_ids)
        ids, mask = left_pad(prompt_ids, s.pad_token_id, dev, vocab_size_of(lm), width=P)
        lengths = mask.sum(1)

        # Prefill through the transformers model: its cache, its hints, the first token's logits; with share_prefill
        # of each distinct prompt once (rows `first`), expanded to its rows by `shared` (row -> prefilled row).
        first, shared = distinct_prompts(prompt_ids, dev) if self.share_prefill else (None, None)
        if first is None:
            logits, cache, recorder = self._prefill(lm, ids, mask, dec.kv_fp4, record)
        else:
            logits, cache, recorder = self._prefill(lm, ids[first], mask[first], dec.kv_fp4, record)
            logits = logits[shared]
        self.stats.prefill_rows += B if first is None else first.numel()
        self._load_cache(dec, cache, lengths, P, src_rows=shared)
        if self._weights.layout.hybrid:  # linear-attention layers: their conv and recurrent states, per row
            dec.load_states(cache, B, shared)
        del cache
        r.reset(s.seed, ids, mask, lengths, logits)
        steps, cur = self._decode(r, s.max_new_tokens, dev)

        completion = r.out_tokens[:B, : steps + 1]
        keep = cut_after_eos(completion, s.eos_token_id) if s.eos_token_id else torch.ones_like(completion, dtype=bool)
        hints = None
        if record:
            full_mask = torch.cat([mask, keep.to(mask.dtype)], dim=1)
            slots = torch.argsort(r.row_ids)[:B] if cur is not r else None  # the decoder row each row ended in
            hints = r.records.hints(recorder, dec, r.out_tokens, B, steps, full_mask, lengths, slots, shared)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        completion_ids, logprobs = to_lists(completion, r.out_logps[:B, : steps + 1], keep)
        return completion_ids, logprobs, hints

    @staticmethod
    def _prefill(lm, ids: torch.Tensor, mask: torch.Tensor, kv_fp4: bool, record: bool):
        """The prefill through the transformers model (eval mode): one forward over the left-padded ``ids`` /
        ``mask`` into an FP4 or a model-dtype KV cache, under a `HintRecorder` when ``record``, keeping the last
        position's logits. Returns (those logits in fp32, the cache, the recorder or a null context). Its own
        method so that `benchmarks.rollout.prefill` times exactly this."""
        cache = fp4_cache(lm.config, "nvfp4") if kv_fp4 else DynamicCache(config=lm.config)
        recorder = HintRecorder(lm) if record else contextlib.nullcontext()
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        with recorder, no_prefill_refresh():  # _weights_for has just refreshed the packed experts
            kw = {_cache_kwarg(lm): cache}
            logits = lm(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                        **kw).logits[:, -1].float()  # fmt: skip
        return logits, cache, recorder

    def _decode(self, r: Runner, max_new: int, dev) -> tuple[int, Runner]:
        """The decode loop of a wave reset in ``r``: step until every row has stopped or ``max_new`` tokens, checking
        the stops (and, with compaction, moving the live rows into a smaller bucket) every ``check_every`` steps.
        Returns (the decode steps run, the runner of the bucket the wave ended in)."""
        steps, cur = 0, r
        trajectory = [(0, r.batch)]
        self.stats.row_steps += r.batch  # the prefill's token
        check = self.check_every if dev.type == "cuda" else 1
        while steps < max_new - 1:
            if steps % check == 0:
                done, gone = torch.stack([r.finished.sum(), r.retired.sum()]).tolist()  # the one synchronization
                if done == r.batch:
                    break
                fits = row_bucket(r.batch - gone)
                if fits < cur.batch and fits in r.smaller:
                    cur = self._compact(r, cur, fits)
                    trajectory.append((steps, cur.batch))
            cur.dec.run()
            steps += 1
            if r.records.streams and steps % r.records.window == 0:
                r.records.flush(steps)
            self.stats.row_steps += cur.batch
        self.stats.steps.append(steps + 1)
        self.stats.buckets.append(trajectory)
        self.stats.compactions += len(trajectory) - 1
        return steps, cur

    @staticmethod
    def _compact(r: Runner, cur: Runner, rows: int) -> Runner:
        """Move the rows of ``cur`` (a bucket of ``r``'s first rows) that are not retired into its first ``rows``
        rows, swapping them with retired ones (whose caches keep the K/V hints still to be read), and return the
        runner of those rows."""
        done = r.retired[: cur.batch]
        a = torch.nonzero(~done[rows:]).view(-1) + rows  # live rows past the new bucket
        b = torch.nonzero(done[:rows]).view(-1)[: a.numel()]  # retired rows inside it (at least as many)
        r.swap_rows(a, b)
        return r.smaller[rows]

    @staticmethod
    def _load_cache(
        dec: FastDecoder, cache, lengths: torch.Tensor, P: int, src_rows: torch.Tensor | None = None
    ) -> None:
        """Copy the prefill's K/V into the decoder's cache, left padding removed (slot j = position j); the
        linear-attention layers' states, per row with no padding to remove, are the decoder's own to load
        (`HybridDecoder.load_states`). ``lengths`` [B]: each decoder row's prompt length; ``src_rows`` [B]: the
        prefill row each decoder row copies (None: its own)."""
        B = lengths.shape[0]
        src = (torch.arange(P, device=lengths.device)[None, :] + (P - lengths)[:, None]).clamp(max=P - 1)

        def put(dst: torch.Tensor, t: torch.Tensor) -> None:  # t [B_src, Hkv, P, ...] -> dst[:B, :, :P]
            if src_rows is not None:
                t = t[src_rows]
            idx = src.view(B, 1, P, *([1] * (t.ndim - 3))).expand(B, t.shape[1], P, *t.shape[3:])
            dst[:B, :, :P].copy_(torch.gather(t, 2, idx).view(dst[:B, :, :P].shape))

        for c, layer in zip(dec.caches, cache.layers, strict=True):
            if c is None:  # linear attention: no K/V
                continue
            if isinstance(layer, FP4KVLayer) and LOAD_KV_KERNEL:
                kernels().ops.load_fp4_kv((c.k, c.k_scale, c.k_g, c.v, c.v_scale, c.v_g), layer.fp4_keys,
                                          layer.fp4_values, lengths, src_rows)  # fmt: skip
            elif isinstance(layer, FP4KVLayer):
                for q, (codes, scale, g) in ((layer.fp4_keys, (c.k, c.k_scale, c.k_g)),
                                             (layer.fp4_values, (c.v, c.v_scale, c.v_g))):  # fmt: skip
                    put(codes, q.packed)
                    put(scale, q.block_scale)
                    put(g, q.global_scale.squeeze(-1))
            else:
                put(c.k, layer.keys.to(c.k.dtype))
                put(c.v, layer.values.to(c.v.dtype))
