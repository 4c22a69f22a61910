# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The rollout engine: batched prefill, then sampling decode steps replayed from a CUDA graph.

Why: `model.generate` spends more time per token in Python and kernel launches than an FP4 decode step of an MoE
model takes on the GPU, which hides everything FP4 saves. The engine keeps generate's function and the
`RolloutOutput` contract, and changes how it runs:

* prefill: one forward of the transformers model over the left-padded prompts (eval mode: FP4 experts, the FP4 or
  BF16 KV cache, a `HintRecorder` for the prompt's hints), keeping only the last position's logits; its K/V are
  copied, left padding removed, into the static cache of `FastDecoder`;
* decode: `FastDecoder.step` (the model's own parameters and packed FP4 experts, fixed kernels, static buffers)
  followed by the sampler (`trace_hf.rollout.sampling`), the per-row EOS stop and the hint/routing records, all
  inside one step that a CUDA graph captures once per (batch, length, sampling) bucket and replays;
* stop: rows that emit an EOS id stop (their later tokens are padding); the loop ends at max_new_tokens or once
  every row has stopped (checked every few steps, the only host synchronization).

Before every rollout the engine refreshes what it reads from the model: packed FP4 experts are re-quantized from
the masters in place (`TraceFP4Experts.refresh_packed`), the fused QKV weight is re-copied, and any parameter whose
storage moved (reloaded) rebuilds the weights and drops the graphs. So the engine sees every update, however it
was made. What it reads, and which decoder steps it, is the model family's entry in `trace_hf.rollout.engine.layouts`
(Qwen3 MoE: `FastDecoder`; Qwen3.5 MoE: `trace_hf.rollout.engine.qwen35.HybridDecoder`). Under FSDP2 the engine owns
full copies of what it reads, refreshed by gathering one layer at a time (`_ShardedWeights`). On CPU it runs eagerly through the Triton interpreter (tests).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict

import torch
from transformers import DynamicCache

from ... import fp4
from ...experts import fp4_experts, no_prefill_refresh
from ...hints import HintRecorder, hint_batch_from_columns, kv_rows
from ...kv_cache import FP4KVLayer, fp4_cache
from ..base import RolloutOutput, causal_lm, cut_after_eos, left_pad, to_lists, vocab_size_of
from ..generate import check_sampling
from ..sampling import SamplingSettings, draw, process_logits, sampler_logprobs
from .decoder import FastDecoder
from .kernels import kernels
from .layouts import layout_of, supported_model_types
from .qwen35 import HybridDecoder
from .weights import DecodeWeights, Dims, EngineWeights, ShardedWeights, engine_weights, sharded


def kv_format(model) -> str | None:
    """The FP4 format of the model's KV cache (`TraceFP4Config.kv_cache`), None for a cache in the model dtype."""
    impl = getattr(model.config, "_attn_implementation", None) or ""
    return impl.split(":")[1] if impl.startswith("trace_fp4_kv:") else None


def unsupported_reason(model, require_cuda: bool = True) -> str | None:
    """Why the engine cannot roll out this model (None: it can). The engine implements the families of
    `trace_hf.rollout.engine.layouts`: Qwen3 MoE-style decoders whose every layer is full-attention MoE (q/k norms, default
    RoPE, SiLU experts, softmax top-k router), and Qwen3.5 MoE (Gated DeltaNet and gated full attention, shared
    expert)."""
    lm = causal_lm(model)
    adapters = _adapter_problems(lm)
    if adapters:
        return adapters
    text = lm.config.get_text_config(decoder=True)
    layout = layout_of(lm.config)
    if layout is None:
        return (f"model type {getattr(text, 'model_type', None)!r} is not one the engine implements "
                f"({', '.join(supported_model_types())})")  # fmt: skip
    try:
        Dims.from_config(lm.config)
    except ValueError as e:
        return str(e)
    mixers = set(getattr(text, "layer_types", None) or ["full_attention"])
    if not mixers <= set(layout.mixers):
        return f"layer types {sorted(mixers - set(layout.mixers))} are not implemented for {layout.family}"
    if layout.hybrid and any(hasattr(m, "lora_A") for m in lm.modules()):
        return f"LoRA adapters are not folded into the {layout.family} engine's weights"
    if layout.hybrid and sharded(lm):
        return f"FSDP2-sharded {layout.family} models are not implemented (Qwen3 MoE ones are)"
    if getattr(text, "use_sliding_window", False):
        return "sliding-window attention is not implemented"
    if getattr(text, "hidden_act", "silu") != "silu":
        return f"experts activation {text.hidden_act!r} is not SiLU"
    if getattr(text, "attention_bias", False):
        return "attention biases are not implemented"
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in lm.modules()):
        return "FSDP1 flat parameters are not supported (FSDP2, `fully_shard`, is)"
    experts = fp4_experts(lm)
    if experts and any(m.fmt != "nvfp4" or m.activations != "fp4" for m in experts):
        return "its FP4 experts are not NVFP4 W4A4 (the engine's kernels)"
    if experts and len(experts) != text.num_hidden_layers:
        return "some MoE layers were left unquantized (modules_to_not_convert)"
    if kv_format(lm) not in (None, "nvfp4"):
        return f"its KV cache is {kv_format(lm)}, the engine's FP4 cache is NVFP4"
    device = next(lm.parameters()).device
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device.type != "cuda" and (require_cuda or not interpreted):
        return "the model is not on a CUDA device (the engine runs on CPU only under TRITON_INTERPRET=1, for tests)"
    return None


#: The linears whose PEFT LoRA adapters the engine folds into its own copies of their weights at every rollout.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _adapter_problems(lm) -> str | None:
    """Why the engine cannot fold this model's PEFT adapters into its weights (None: it can, or there are none)."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:  # PEFT before 0.15
        from peft.utils.other import ModulesToSaveWrapper as AuxiliaryTrainingWrapper

    bad = []
    for name, m in lm.named_modules():
        if isinstance(m, AuxiliaryTrainingWrapper):
            bad.append(f"{name} ({type(m).__name__}: modules_to_save / trainable tokens)")
        elif isinstance(m, BaseTunerLayer):
            leaf = name.rsplit(".", 1)[-1]
            if not isinstance(m, LoraLinear) or leaf not in LORA_TARGETS or ".self_attn." not in f".{name}":
                bad.append(f"{name} ({type(m).__module__.split('.')[-2]} on {leaf})")
            elif any(
                getattr(m, attr, {}).get(a)
                for attr in ("lora_variant", "use_dora", "lora_bias")
                for a in m.active_adapters
            ):
                bad.append(f"{name} (a LoRA variant such as DoRA, or lora_bias)")
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        return (
            f"its PEFT adapters on {shown} are not folded into the engine's weights (it folds plain LoRA on the "
            f"attention projections {list(LORA_TARGETS)})"
        )
    return None


def _cache_kwarg(lm) -> str:
    """transformers renamed the forward's cache argument `past_key_values` -> `cache` (5.2x)."""
    import inspect

    return "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"


def _bucket(n: int, step: int) -> int:
    return -(-n // step) * step


class _Runner:
    """Static buffers, the decoder and (on CUDA) the captured step of one (batch, length, sampling) bucket."""

    def __init__(self, w: DecodeWeights, batch: int, max_len: int, s: SamplingSettings, kv_fp4: bool, record: bool,
                 decoder: type[FastDecoder] = FastDecoder):  # fmt: skip
        d = w.dims
        self.s, self.batch, self.record = s, batch, record
        self.dec = decoder(w, batch, max_len, kv_fp4=kv_fp4, record_hints=record,
                           record_routing=record, sample=self._sample)  # fmt: skip
        dev = self.dec.device
        n = s.max_new_tokens
        self.seed = torch.zeros(1, dtype=torch.int64, device=dev)
        self.step = torch.zeros(1, dtype=torch.int64, device=dev)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.eos = torch.tensor(list(s.eos_token_id) or [-1], dtype=torch.int64, device=dev)
        self.out_tokens = torch.zeros(batch, n, dtype=torch.int64, device=dev)
        self.out_logps = torch.zeros(batch, n, dtype=torch.float32, device=dev)
        self.seen = torch.zeros(batch, d.vocab, dtype=torch.bool, device=dev) if s.repetition_penalty else None
        H, n_h = d.hidden, len(self.dec.hinted)
        rec_n = n if record else 0
        self.rec_bits = torch.zeros(n_h, batch, rec_n, H // 8, dtype=torch.uint8, device=dev)
        self.rec_scale = torch.zeros(n_h, batch, rec_n, H // 16, dtype=torch.uint8, device=dev)
        self.rec_g = torch.zeros(n_h, batch, rec_n, dtype=torch.float32, device=dev)
        dh = self.dec
        self.rec_hidden = tuple(torch.zeros(t.shape[0], batch, rec_n, *t.shape[2:], dtype=t.dtype, device=dev)
                                for t in (dh.hidden_bits, dh.hidden_scale, dh.hidden_g))  # fmt: skip
        self.rec_route = torch.zeros(d.num_layers if record else 0, batch, rec_n, d.top_k, dtype=torch.int16,
                                     device=dev)  # fmt: skip
        self.graph_ready = False

    def _sample(self, dec: FastDecoder) -> None:
        """End of a decode step (graph-safe): draw the next token, record it, its log-prob and the step's hints."""
        s = self.s
        x = process_logits(dec.logits, s, self.seen)
        tok = draw(x, s, self.seed, self.step)
        lp = sampler_logprobs(dec.logits, tok, s)
        tok = torch.where(self.finished, torch.full_like(tok, s.pad_token_id), tok)
        col = (self.step + 1).view(1, 1).expand(self.batch, 1)
        self.out_tokens.scatter_(1, col, tok.unsqueeze(1))
        self.out_logps.scatter_(1, col, lp.unsqueeze(1))
        if self.record:
            if dec.hinted:
                self.rec_bits.index_copy_(2, self.step, dec.hint_bits.unsqueeze(2))
                self.rec_scale.index_copy_(2, self.step, dec.hint_scale.unsqueeze(2))
                self.rec_g.index_copy_(2, self.step, dec.hint_g.unsqueeze(2))
            if dec.hidden_hinted:
                for rec, t in zip(self.rec_hidden, (dec.hidden_bits, dec.hidden_scale, dec.hidden_g), strict=True):
                    rec.index_copy_(2, self.step, t.unsqueeze(2))
            self.rec_route.index_copy_(2, self.step, dec.routing.unsqueeze(2))
        self.finished |= torch.isin(tok, self.eos)
        if self.seen is not None:
            self.seen.scatter_(1, tok.unsqueeze(1), True)
        dec.tokens.copy_(tok)
        self.step.add_(1)

    def capture(self) -> None:
        self.step.zero_()
        self.finished.zero_()
        self.dec.capture()
        self.graph_ready = True


class EngineRollout:
    """Rolls out through the engine (see the module docstring). Keeps the decoders of the last ``max_buckets``
    (batch, length, sampling) buckets, with their graphs, across calls.

    Args:
        max_buckets: decoders (KV caches and graphs) kept alive at once.
        length_bucket: cache lengths are rounded up to a multiple of this, so prompts of other lengths reuse a
            graph.
        check_every: decode steps between checks that every row has stopped (each check synchronizes).
        use_graphs: capture the decode step in a CUDA graph (default: on CUDA).
    """

    name = "engine"

    def __init__(self, max_buckets: int = 2, length_bucket: int = 256, check_every: int = 8, use_graphs=None):
        self.max_buckets, self.length_bucket, self.check_every = max_buckets, length_bucket, check_every
        self.use_graphs = use_graphs
        self._model = None
        self._weights: EngineWeights | ShardedWeights | None = None
        self._runners: OrderedDict = OrderedDict()

    # -- weights and buckets ------------------------------------------------------------------------------------

    def _weights_for(self, lm) -> DecodeWeights:
        if self._model is not lm:
            self._runners.clear()
            self._weights, self._model = engine_weights(lm, layout_of(lm.config)), lm
        elif not self._weights.refresh():
            self._runners.clear()
        return self._weights.w

    def _runner(self, w: DecodeWeights, batch: int, length: int, s: SamplingSettings, kv_fp4: bool, record: bool):
        key = (batch, length, s.key(), s.max_new_tokens, kv_fp4, record)
        if key in self._runners:
            self._runners.move_to_end(key)
            return self._runners[key]
        while len(self._runners) >= self.max_buckets:
            self._runners.popitem(last=False)
        dev = w.embed.device
        self._check_memory(w, batch, length, s, kv_fp4, record, dev)
        try:
            runner = _Runner(w, batch, length, s, kv_fp4, record, layout_of(self._model.config).decoder)
            graphs = dev.type == "cuda" if self.use_graphs is None else self.use_graphs
            if graphs and s.max_new_tokens > 3:
                runner.capture()
        except torch.OutOfMemoryError as e:
            self._runners.clear()
            raise torch.OutOfMemoryError(self._memory_message(batch, length)) from e
        self._runners[key] = runner
        return runner

    @staticmethod
    def _memory_message(batch: int, length: int) -> str:
        return (
            f"The rollout engine cannot fit {batch} rows x {length} tokens (KV cache, logits and graph buffers) "
            "on this GPU. Lower per_device_train_batch_size x steps_per_generation (rows per rollout), "
            "max_completion_length or max_prompt_length, or roll out with rollout_engine='generate'."
        )

    def _check_memory(self, w, batch, length, s, kv_fp4, record, dev) -> None:
        if dev.type != "cuda":
            return
        d = w.dims
        A = kernels().attention
        kv = A.kv_bytes_per_token(d.num_kv_heads, d.head_dim, kv_fp4, w.embed.element_size()) * w.num_kv_layers
        need = batch * length * kv + 8 * batch * d.vocab * 4  # cache + the sampler's [B, V] fp32 temporaries
        need += batch * w.state_bytes_per_row()
        if record:
            n_hidden = sum(lw.hinted and "experts_hidden" in lw.hint_sites for lw in w.layers)
            need += batch * s.max_new_tokens * (d.num_layers * (d.hidden // 8 + d.hidden // 16 + 4) + 2 * d.top_k
                                                * d.num_layers)  # fmt: skip
            need += batch * s.max_new_tokens * n_hidden * d.top_k * (d.expert_dim // 8 + d.expert_dim // 16 + 4)
        free, _ = torch.cuda.mem_get_info(dev)
        free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        if need > free:
            raise torch.OutOfMemoryError(
                self._memory_message(batch, length) + f" It needs about {need / 2**30:.1f} GiB, "
                f"{free / 2**30:.1f} GiB are free."
            )

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
        B = len(prompt_ids)
        ids, mask = left_pad(prompt_ids, s.pad_token_id, dev, vocab_size_of(lm))
        P = ids.shape[1]
        batch = B if dev.type != "cuda" else 1 << max(0, (B - 1).bit_length())
        length = _bucket(P + s.max_new_tokens, self.length_bucket if dev.type == "cuda" else 1)
        kv_fp4 = kv_format(lm) is not None
        r = self._runner(w, batch, length, s, kv_fp4, record)
        dec = r.dec

        # Prefill through the transformers model: its cache, its hints, the first token's logits.
        cache = fp4_cache(lm.config, "nvfp4") if kv_fp4 else DynamicCache(config=lm.config)
        recorder = HintRecorder(lm) if record else contextlib.nullcontext()
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        with recorder, no_prefill_refresh():  # _weights_for has just refreshed the packed experts
            kw = {_cache_kwarg(lm): cache}
            logits = lm(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                        **kw).logits[:, -1].float()  # fmt: skip
        lengths = mask.sum(1)
        self._load_cache(dec, cache, lengths, P)

        # State of the decode loop; rows past B are padding, stopped from the start.
        r.seed.fill_(s.seed)
        r.step.fill_(-1)  # the first draw (from the prefill logits) uses step -1
        r.finished.zero_()
        r.finished[B:] = True
        if r.seen is not None:
            r.seen.zero_()
            r.seen[:B].scatter_(1, torch.where(mask.bool(), ids, ids[:, -1:]), True)  # pads: the last (real) id
        x = process_logits(logits, s, None if r.seen is None else r.seen[:B])
        tok0 = draw(x, s, r.seed, r.step)
        r.out_tokens.zero_()
        r.out_tokens[:B, 0] = tok0
        r.out_logps[:B, 0] = sampler_logprobs(logits, tok0, s)
        r.finished[:B] |= torch.isin(tok0, r.eos)
        if r.seen is not None:
            r.seen[:B].scatter_(1, tok0.unsqueeze(1), True)
        dec.tokens.zero_()
        dec.tokens[:B] = tok0
        dec.positions.zero_()
        dec.positions[:B] = lengths.to(torch.int32)
        r.step.zero_()

        steps = 0
        check = self.check_every if dev.type == "cuda" else 1
        while steps < s.max_new_tokens - 1:
            if steps % check == 0 and bool(r.finished.all()):
                break
            dec.run()
            steps += 1

        completion = r.out_tokens[:B, : steps + 1]
        keep = cut_after_eos(completion, s.eos_token_id) if s.eos_token_id else torch.ones_like(completion, dtype=bool)
        hints = None
        if record:
            hints = self._hints(recorder, r, B, steps, torch.cat([mask, keep.to(mask.dtype)], dim=1), lengths)
            if storage == "cpu":
                hints = hints.to("cpu")
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        completion_ids, logprobs = to_lists(completion, r.out_logps[:B, : steps + 1], keep)
        return RolloutOutput(completion_ids, logprobs, hints, self.name)

    @staticmethod
    def _load_cache(dec: FastDecoder, cache, lengths: torch.Tensor, P: int) -> None:
        """Copy the prefill's K/V into the decoder's cache, left padding removed (slot j = position j), and the
        linear-attention layers' conv and recurrent states (per row: no padding to remove)."""
        B = lengths.shape[0]
        src = (torch.arange(P, device=lengths.device)[None, :] + (P - lengths)[:, None]).clamp(max=P - 1)

        def put(dst: torch.Tensor, t: torch.Tensor) -> None:  # t [B, Hkv, P, ...] -> dst[:B, :, :P]
            idx = src.view(B, 1, P, *([1] * (t.ndim - 3))).expand(B, t.shape[1], P, *t.shape[3:])
            dst[:B, :, :P].copy_(torch.gather(t, 2, idx).view(dst[:B, :, :P].shape))

        if isinstance(dec, HybridDecoder):
            dec.load_states(cache, B)
        for c, layer in zip(dec.caches, cache.layers, strict=True):
            if c is None:  # linear attention: its states were loaded above
                continue
            if isinstance(layer, FP4KVLayer):
                for q, (codes, scale, g) in ((layer.fp4_keys, (c.k, c.k_scale, c.k_g)),
                                          (layer.fp4_values, (c.v, c.v_scale, c.v_g))):  # fmt: skip
                    put(codes, q.packed)
                    put(scale, q.block_scale)
                    put(g, q.global_scale.squeeze(-1))
            else:
                put(c.k, layer.keys.to(c.k.dtype))
                put(c.v, layer.values.to(c.v.dtype))

    @staticmethod
    def _hints(recorder: HintRecorder, r: _Runner, B: int, steps: int, full_mask: torch.Tensor, lengths):
        """Prompt columns from the prefill's recorder, then one column per decode step (its input token); the decode
        steps' K/V hints are read from the decoder's FP4 cache afterwards (the codes attention read)."""
        bits, scales, gscale, routing, ids = recorder.columns()

        def cols(t):  # [n_layers, batch, n, ...] -> [B, steps, n_layers, ...]
            return t[:, :B, :steps].movedim(0, 2)

        def decoded(site):
            if site == "experts_hidden":
                return tuple(cols(t) for t in r.rec_hidden)
            return _kv_hints(r.dec, [recorder.experts[i].kv_layer for i in recorder.plan["kv"]], lengths, steps)

        sites = {
            site: tuple(torch.cat([a, b], dim=1) for a, b in zip(ts, decoded(site), strict=True))
            for site, ts in recorder.site_columns().items()
        }

        bits = torch.cat([bits, cols(r.rec_bits)], dim=1)
        scales = torch.cat([scales, cols(r.rec_scale)], dim=1)
        gscale = torch.cat([gscale, cols(r.rec_g)], dim=1)
        routing = torch.cat([routing, cols(r.rec_route)], dim=1)
        ids = torch.cat([ids, r.out_tokens[:B, :steps].to(ids.dtype)], dim=1)  # decode step s fed completion token s
        return hint_batch_from_columns(bits, scales, gscale, routing, full_mask, recorder.fmt, recorder.hint_layers,
                                       ids, site_columns=sites)  # fmt: skip


def _kv_hints(dec: FastDecoder, layers: list[int], lengths: torch.Tensor, steps: int):
    """The "kv" hints of the decode steps at decoder layers `layers`, [B, steps, n_layers, 2, kv_heads, ...] (bits,
    block scales, row scales), from the FP4 cache: step s of row b wrote position ``lengths[b] + s`` there."""
    B = lengths.shape[0]
    where = lengths[:, None].long() + torch.arange(steps, device=lengths.device)  # [B, steps]

    def take(t):  # [batch, kv_heads, T, ...] -> [B, kv_heads, steps, ...]
        idx = where.view(B, 1, steps, *([1] * (t.ndim - 3))).expand(B, t.shape[1], steps, *t.shape[3:])
        return torch.gather(t[:B], 2, idx)

    per_layer = []
    for j in layers:
        c = dec.caches[j]
        qk, qv = (fp4.FP4Tensor(take(q), take(sc), take(g).unsqueeze(-1), "nvfp4")
                  for q, sc, g in ((c.k, c.k_scale, c.k_g), (c.v, c.v_scale, c.v_g)))  # fmt: skip
        h = fp4.extract_hints(kv_rows(qk, qv))
        per_layer.append((h.mantissa_bits, h.block_scale, h.global_scale.squeeze(-1)))
    return tuple(torch.stack([p[k] for p in per_layer], dim=1).unflatten(0, (B, steps)) for k in range(3))
