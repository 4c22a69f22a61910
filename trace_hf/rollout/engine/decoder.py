# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""A static-shape decode step for the Qwen3 MoE architecture, captured in one CUDA graph.

Why: on Hopper the FP4 rollout wins only by reading fewer bytes (packed FP4 experts, FP4 KV cache), and a
decode step of a 48-layer MoE model moves a few GB in about a millisecond; `model.generate` spends more than
that in Python and kernel launches. This module computes the same function as the transformers model's eval
path (with `TraceFP4Config`: W4A4 FP4 experts, FP4 KV cache, hints) with a fixed set of kernels per layer
(~14) over static buffers, so that the whole step replays from one CUDA graph.

Per layer: add + RMSNorm (`decode_ops`), fused QKV projection (BF16 GEMM), q/k RMSNorm + RoPE + KV-cache write
(`fp4_attention.qkv_post`), split-K decode attention, o_proj, add + RMSNorm fused with the experts' input
quantization per token (`add_rmsnorm_fp4`: the hints of hinted layers go straight into static buffers), router
GEMM, softmax + top-k, routed experts (`fp4_moe`; at layers hinted at "experts_hidden" also the hints of the
hidden they quantized, in slot order), whose per-slot outputs the next norm sums. Then the final norm, lm_head and
the greedy next token (or the rollout engine's sampler, `trace_hf.rollout.engine`), which becomes the next step's
input. At batch 1 the QKV, o_proj and router products run `decode_ops.gemv` (cuBLAS leaves most of the GPU idle
on one row).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F

from ... import fp4
from ...fp4 import FP4Tensor
from .kernels import kernels
from .weights import DecodeWeights, Dims


def rope_tables(dims: Dims, max_len: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_len, D] as transformers computes them (fp32, then rounded to the model dtype), kept fp32."""
    D = dims.head_dim
    inv_freq = 1.0 / (dims.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).to(torch.float) / D))
    pos = torch.arange(max_len, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos().to(dtype).float().to(device).contiguous(), emb.sin().to(dtype).float().to(device).contiguous())


# ----------------------------------------------------------------------------------------------------------
# The decoder
# ----------------------------------------------------------------------------------------------------------


class FastDecoder:
    """Static buffers, caches and one decode step for a batch of ``batch`` sequences of up to ``max_len`` tokens.

    Args:
        weights: `DecodeWeights` (FP4 experts give the W4A4 path; dense experts the BF16 path).
        kv_fp4: FP4 (NVFP4, per token and head) KV cache, else a cache in the model dtype.
        record_hints: write the hints of hinted layers (mantissa bits, block scales, row scale) of every step: of the
            experts input into `hint_bits` / `hint_scale` / `hint_g` ([n_hinted, batch, ...]), and at layers hinted at
            "experts_hidden" of the down projection's input per slot into `hidden_bits` / `hidden_scale` /
            `hidden_g` ([n_hidden, batch, top_k, ...], slots in the router's order).
        record_routing: write every layer's routed expert ids into `routing` ([num_layers, batch, top_k] int16).
        sample: called at the end of each step with the decoder, instead of the greedy argmax: it reads `logits` and
            writes the next `tokens` (the rollout engine's sampler and stop bookkeeping; must be graph-safe).

    `tokens` [B] (int64) holds the step's input tokens and receives the greedy next tokens; `positions` [B]
    (int32) the position each sequence writes (its cache length before the step), incremented by the step;
    `logits` [B, V] the step's logits, in the model dtype (the lm_head's output).
    """

    #: The norms round the normalized value to the model dtype before the weight (Qwen3's RMSNorm; `add_rmsnorm`).
    round_normalized = True
    #: Per-row buffers (attribute: its batch dimension); tensors, or per-layer lists of tensors or `KVCache`s.
    row_buffers = {"tokens": 0, "positions": 0, "logits": 0, "caches": 0, "hint_bits": 1, "hint_scale": 1,
                   "hint_g": 1, "hidden_bits": 1, "hidden_scale": 1, "hidden_g": 1, "routing": 1}  # fmt: skip
    #: The row buffers a sequence carries from one step to the next (the rest is rewritten every step).
    carried = ("tokens", "positions", "caches")

    def __init__(
        self,
        weights: DecodeWeights,
        batch: int,
        max_len: int,
        kv_fp4: bool = True,
        record_hints: bool = True,
        record_routing: bool = False,
        sample=None,
    ):
        A = kernels().attention
        self.w = weights
        d = weights.dims
        self.dims, self.batch, self.max_len, self.kv_fp4 = d, batch, max_len, kv_fp4
        self.device = weights.embed.device
        self.dtype = weights.dtype
        self.fp4_experts = weights.fp4_experts
        self.record_hints = record_hints and self.fp4_experts
        self.caches = [
            A.allocate_kv_cache(batch, d.num_kv_heads, max_len, d.head_dim, kv_fp4, self.dtype, self.device)
            if self._has_kv(i) else None
            for i in range(d.num_layers)
        ]  # fmt: skip
        self.cos, self.sin = rope_tables(d, max_len, self.dtype, self.device)
        self.splits = self._splits(batch)
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self.logits = torch.zeros(batch, d.vocab, dtype=weights.lm_head.dtype, device=self.device)
        self.hinted = self._hinted_at("experts_input")
        n_h, H = len(self.hinted), d.hidden
        self.hint_bits = torch.zeros(n_h, batch, H // 8, dtype=torch.uint8, device=self.device)
        self.hint_scale = torch.zeros(n_h, batch, H // 16, dtype=torch.uint8, device=self.device)
        self.hint_g = torch.zeros(n_h, batch, dtype=torch.float32, device=self.device)
        self.hidden_hinted = self._hinted_at("experts_hidden")
        n_hh, width, k = len(self.hidden_hinted), d.expert_dim, d.top_k
        self.hidden_bits = torch.zeros(n_hh, batch, k, width // 8, dtype=torch.uint8, device=self.device)
        self.hidden_scale = torch.zeros(n_hh, batch, k, width // 16, dtype=torch.uint8, device=self.device)
        self.hidden_g = torch.zeros(n_hh, batch, k, dtype=torch.float32, device=self.device)
        self.record_routing = record_routing
        self.routing = torch.zeros(d.num_layers if record_routing else 0, batch, d.top_k, dtype=torch.int16,
                                   device=self.device)  # fmt: skip
        self.sample = sample
        self.graph = None

    # -- pieces ---------------------------------------------------------------------------------------------

    def _splits(self, batch: int) -> tuple[int, int]:
        A, d = kernels().attention, self.dims
        hopper = A.uses_hopper_kernel(self.kv_fp4, d.head_dim, self.device)
        return A.num_splits(batch, d.num_kv_heads, self.max_len, hopper, d.head_dim)

    def _has_kv(self, layer: int) -> bool:
        """Whether decoder layer `layer` keeps a K/V cache (every Qwen3 layer does; see `HybridDecoder`)."""
        return True

    def _hinted_at(self, site: str) -> list[int]:
        if not self.fp4_experts:
            return []
        return [i for i, lw in enumerate(self.w.layers) if lw.hinted and site in lw.hint_sites]

    def _add_rmsnorm(self, res, add, w):
        return kernels().ops.add_rmsnorm(res, add, w, self.dims.eps)

    def _add_rmsnorm_fp4(self, res, add, w, layer: int) -> tuple[torch.Tensor, FP4Tensor]:
        """The post-attention norm and the experts' input quantized per token in one launch; at hinted layers the
        hints go straight into the static buffers."""
        hints = None
        if self.record_hints and self.w.layers[layer].hinted:
            j = self.hinted.index(layer)
            hints = fp4.FP4Hints(self.hint_bits[j], self.hint_scale[j], self.hint_g[j].view(-1, 1), "nvfp4")
        return kernels().ops.add_rmsnorm_fp4(res, add, w, self.dims.eps, hints=hints,
                                             round_normalized=self.round_normalized)  # fmt: skip

    def _experts_recording_hidden(self, xq, ids, tw, layer: int) -> torch.Tensor:
        """The routed experts of a layer hinted at "experts_hidden", keeping the hints of the hidden activation they
        quantized, put in slot order (graph-safe)."""
        lw = self.w.layers[layer]
        y, hidden = kernels().moe.experts_from_quantized(xq, ids, tw, lw.gate_up, lw.down, True, return_hidden=True)
        j, pos = self.hidden_hinted.index(layer), hidden.positions()
        h = hidden.hints
        for dst, src in ((self.hidden_bits, h.mantissa_bits), (self.hidden_scale, h.block_scale),
                         (self.hidden_g, h.global_scale.squeeze(-1))):  # fmt: skip
            dst[j].copy_(src[pos].view(dst[j].shape))
        return y

    def step(self) -> None:
        """One decode step on the static buffers (no host synchronization, so it can be graph-captured)."""
        d, B = self.dims, self.batch
        k = kernels()
        dec, A, moe = k.ops, k.attention, k.moe
        res = F.embedding(self.tokens, self.w.embed)
        lengths = self.positions + 1
        pending = None
        for i, lw in enumerate(self.w.layers):
            c = self.caches[i]
            xn = self._add_rmsnorm(res, pending, lw.ln_in)
            qkv = dec.linear(xn, lw.w_qkv)  # one row: `decode_ops.gemv`, else cuBLAS
            q = A.qkv_post(qkv, c, self.positions, d.num_heads, d.num_kv_heads, lw.q_norm, lw.k_norm, self.cos,
                           self.sin, d.eps)  # fmt: skip
            attn = A.decode_attention(q, c, lengths, splits=self.splits)
            o = dec.linear(attn.view(B, -1), lw.w_o)
            if self.fp4_experts:
                xn, xq = self._add_rmsnorm_fp4(res, o.unsqueeze(1), lw.ln_post, i)
            else:
                xn = xq = self._add_rmsnorm(res, o.unsqueeze(1), lw.ln_post)
            ids, tw = dec.router_topk(dec.linear(xn, lw.w_router), d.top_k, d.norm_topk_prob)
            if self.record_routing:
                self.routing[i].copy_(ids)
            if self.record_hints and i in self.hidden_hinted:
                pending = self._experts_recording_hidden(xq, ids, tw, i)
            else:
                pending = moe.experts_from_quantized(xq, ids, tw, lw.gate_up, lw.down, hidden_fp4=self.fp4_experts)
        xn = self._add_rmsnorm(res, pending, self.w.norm)
        self._next_token(xn)

    def _next_token(self, xn: torch.Tensor) -> None:
        """The step's tail, shared by every decoder: lm_head logits of the final-normed hidden ``xn``, the sampler
        (greedy without one), and the positions one further."""
        self._lm_head(xn)
        if self.sample is None:
            self.tokens.copy_(torch.argmax(self.logits, dim=-1))
        else:
            self.sample(self)
        self.positions.add_(1)

    def _lm_head(self, xn: torch.Tensor) -> None:
        """The logits into `logits`, in the lm_head's dtype: no fp32 copy, the sampler reads them once."""
        torch.mm(xn, self.w.lm_head.t(), out=self.logits)

    # -- graph ----------------------------------------------------------------------------------------------

    def capture(self, warmup: int = 2, pool=None) -> None:
        """Capture `step` in a CUDA graph (after ``warmup`` eager steps, which compile the kernels; the token
        and position buffers are restored afterwards). ``pool``: another graph's memory pool to share (graphs that
        never run at once, whose steps keep nothing in it between replays)."""
        tokens, positions = self.tokens.clone(), self.positions.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), kernels().pdl.for_rows(self.batch):
            for _ in range(warmup):
                self.step()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool), kernels().pdl.for_rows(self.batch):
            self.step()
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        torch.cuda.synchronize()

    def run(self) -> None:
        """One step: graph replay when captured, else eager."""
        if self.graph is not None:
            self.graph.replay()
        else:
            with kernels().pdl.for_rows(self.batch):
                self.step()

    # -- rows -----------------------------------------------------------------------------------------------

    def first_rows(self, rows: int, sample=None) -> FastDecoder:
        """A decoder of this one's first ``rows`` rows: views of the same caches, states and buffers, with its own
        batch, split-K plan and graph (the engine moves a wave's live rows to the front and steps on in it)."""
        if not 1 <= rows <= self.batch:
            raise ValueError(f"rows={rows}: a decoder of {self.batch} rows has 1 to {self.batch} first rows.")
        v = copy.copy(self)
        v.batch, v.sample, v.graph, v.splits = rows, sample, None, self._splits(rows)
        for name, dim in self.row_buffers.items():
            setattr(v, name, _first(getattr(self, name), rows, dim))
        return v

    def carried_tensors(self) -> list[torch.Tensor]:
        """The tensors of the `carried` buffers (batch on dimension 0)."""
        return [t for name in self.carried for t in _tensors(getattr(self, name))]


def _first(x, rows: int, dim: int):
    """The first ``rows`` rows (along ``dim``) of a tensor, a dataclass of tensors (`KVCache`) or a list of them."""
    if x is None:
        return None
    if isinstance(x, list):
        return [_first(t, rows, dim) for t in x]
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: _first(getattr(x, f.name), rows, dim) for f in dataclasses.fields(x)})
    return x.narrow(dim, 0, rows)


def _tensors(x) -> list[torch.Tensor]:
    if x is None:
        return []
    if isinstance(x, list):
        return [t for y in x for t in _tensors(y)]
    if dataclasses.is_dataclass(x):
        return [t for f in dataclasses.fields(x) for t in _tensors(getattr(x, f.name))]
    return [x]


def swap_rows(tensors: list[torch.Tensor], a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange rows ``a`` and ``b`` (dimension 0) of each tensor, one tensor at a time (a gather of 2n rows)."""
    dst, src = torch.cat([a, b]), torch.cat([b, a])
    for t in tensors:
        t.index_copy_(0, dst, t.index_select(0, src))


__all__ = ["FastDecoder", "rope_tables", "swap_rows"]
