# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The decode step of Qwen3.5 MoE (hybrid Gated DeltaNet / gated full attention), for the rollout engine.

Per layer: add + RMSNorm (`decode_ops`, the model's ``1 + w`` norm weights kept in fp32), then the layer's token
mixer, then what Qwen3's step does (add + RMSNorm fused with the experts' input quantization and its hints, router,
routed experts through `fp4_moe`) plus the shared expert, whose output and sigmoid gate the next norm adds to the
routed slots it sums (`decode_ops.add_rmsnorm`'s ``gated``).

* Full-attention layers (`layer_types` ``"full_attention"``): one projection [q; k; v; output gate], then one
  `fp4_attention.qkv_post` launch: q/k RMSNorm and partial RoPE, rounded where transformers' ops round
  (``round_like_torch``), K/V quantized and stored in the engine's static cache (the FP4 cache holds what
  transformers' FP4 cache holds), then `fp4_attention.decode_attention`, ``* sigmoid(gate)``, ``o_proj``.
* Linear-attention layers (Gated DeltaNet): one projection [q k v; z; b; a], the causal conv1d over a static
  [B, C, kernel] window, one step of the gated delta rule on a static fp32 state [B, Hv, Dk, Dv], the gated
  RMSNorm and ``out_proj``.

Gated DeltaNet's step between the projections, ``delta_rule``: ``"torch"`` follows transformers' torch path op for
op (what `generate` runs without the extras), some 45 launches a layer that pass over the state six times;
``"triton"`` is `trace_hf.kernels.gated_delta`'s three launches (conv and norms; gates and rule; gated norm: the
state read and written once, the same function up to fp32 summation order), the default on CUDA. We wrote those
rather than take flash-linear-attention's ``fused_recurrent_gated_delta_rule`` or causal-conv1d's
``causal_conv1d_update``: ours run under the CPU Triton interpreter (CI) and inside CUDA graphs whatever the Triton
(fla gates its kernels on Triton versions; its chunked backward refuses the H200 image's 3.6; causal-conv1d is a
CUDA extension). The torch ops stay the default on CPU. The prefill stays the model's own forward (fla and
causal-conv1d speed it up when installed: ``pip install trace-hf[qwen35]``), and its final conv and recurrent states
are copied into the decoder's state (`HybridDecoder.load_states`). transformers zeroes the hidden states of padded positions
before the linear-attention projections, so a left-padded row's states equal those of its unpadded prompt and are
copied as they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .decoder import FastDecoder
from .kernels import kernels
from .weights import DecodeWeights, Dims


@dataclass
class HybridDims(Dims):
    """`Dims` plus what Qwen3.5's layers add: the layer pattern, partial RoPE, Gated DeltaNet and shared expert."""

    layer_types: tuple[str, ...] = ()
    rotary_dim: int = 0
    lin_k_heads: int = 0
    lin_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    conv_kernel: int = 0
    shared_dim: int = 0

    @classmethod
    def from_config(cls, config) -> HybridDims:
        base = Dims.from_config(config)
        c = config.get_text_config(decoder=True)
        rope = getattr(c, "rope_parameters", None) or {}
        rotary = int(base.head_dim * rope.get("partial_rotary_factor", 1.0))
        return cls(
            **dataclasses.asdict(base), layer_types=tuple(c.layer_types), rotary_dim=rotary,
            lin_k_heads=c.linear_num_key_heads, lin_v_heads=c.linear_num_value_heads, lin_k_dim=c.linear_key_head_dim,
            lin_v_dim=c.linear_value_head_dim, conv_kernel=c.linear_conv_kernel_dim,
            shared_dim=c.shared_expert_intermediate_size,
        )  # fmt: skip

    @property
    def conv_dim(self) -> int:
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim


@dataclass
class HybridLayerWeights:
    """One Qwen3.5 decoder layer. ``w_in``: full attention [q; k; v; gate] rows, linear attention [qkv; z; b; a]
    rows. Norm weights are the model's ``1 + w`` in fp32."""

    kind: str  # "full_attention" | "linear_attention"
    ln_in: torch.Tensor
    w_in: torch.Tensor
    w_out: torch.Tensor
    ln_post: torch.Tensor
    w_router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    w_shared: torch.Tensor  # [gate_proj; up_proj; shared_expert_gate; zeros] rows: see `pad_rows`
    w_shared_down: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    conv: torch.Tensor | None = None  # [C, kernel]
    a_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    gate_norm: torch.Tensor | None = None  # the gated RMSNorm's weight (not offset)
    hinted: bool = False
    hint_sites: tuple[str, ...] = ("experts_input",)


@dataclass
class HybridDecodeWeights(DecodeWeights):
    @property
    def num_kv_layers(self) -> int:
        return sum(t == "full_attention" for t in self.dims.layer_types)

    def state_bytes_per_row(self) -> int:
        d = self.dims
        n = len(d.layer_types) - self.num_kv_layers
        return n * (
            d.conv_dim * d.conv_kernel * self.embed.element_size() + d.lin_v_heads * d.lin_k_dim * d.lin_v_dim * 4
        )


def pad_rows(w: torch.Tensor, multiple: int = 8) -> torch.Tensor:
    """``w`` with zero rows appended up to a multiple of ``multiple``: the shared expert's [gate; up; sigmoid gate]
    has 2 I + 1 rows, and cuBLAS runs a GEMM with an odd output width on an unaligned kernel (12 us a layer at the
    35B-A3B shape and 64 rows, profiled: docs/lab-notes.md 7d)."""
    pad = -w.shape[0] % multiple
    return torch.cat([w, w.new_zeros(pad, w.shape[1])]) if pad else w


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class HybridDecoder(FastDecoder):
    """`FastDecoder` for Qwen3.5 MoE: K/V caches at full-attention layers only, static conv and recurrent states
    at linear-attention layers (`conv_states` [B, C, kernel] in the model dtype, `recurrent_states`
    [B, Hv, Dk, Dv] fp32, None elsewhere). Same buffers, hint and routing records and sampler hook.

    ``delta_rule``: ``"torch"`` (transformers' Gated DeltaNet step, op for op), ``"triton"``
    (`trace_hf.kernels.gated_delta`: conv, norms, gates, rule and gated norm in three launches, the state read and
    written once; the same function up to fp32 summation order) or ``"auto"``: Triton on CUDA, torch elsewhere."""

    round_normalized = False  # Qwen3.5's RMSNorm: fp32 normalized value times fp32 (1 + w), rounded once
    row_buffers = {**FastDecoder.row_buffers, "conv_states": 0, "recurrent_states": 0}
    carried = (*FastDecoder.carried, "conv_states", "recurrent_states")

    def __init__(self, weights: HybridDecodeWeights, batch: int, max_len: int, kv_fp4: bool = True,
                 record_hints: bool = True, record_routing: bool = False, sample=None,
                 delta_rule: str = "auto"):  # fmt: skip
        if delta_rule not in ("auto", "torch", "triton"):
            raise ValueError(f"delta_rule={delta_rule!r}: use 'auto', 'torch' or 'triton'.")
        super().__init__(weights, batch, max_len, kv_fp4, record_hints, record_routing, sample)
        d, dev = self.dims, self.device
        self.delta_rule = ("triton" if dev.type == "cuda" else "torch") if delta_rule == "auto" else delta_rule
        linear = [t == "linear_attention" for t in d.layer_types]
        self.conv_states = [torch.zeros(batch, d.conv_dim, d.conv_kernel, dtype=self.dtype, device=dev) if lin else None
                            for lin in linear]  # fmt: skip
        self.recurrent_states = [
            torch.zeros(batch, d.lin_v_heads, d.lin_k_dim, d.lin_v_dim, dtype=torch.float32, device=dev) if lin else None
            for lin in linear
        ]  # fmt: skip
        # transformers' partial RoPE tables: fp32 angles, rounded to the model dtype.
        r = d.rotary_dim
        inv_freq = 1.0 / (d.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float) / r))
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(self.dtype).to(dev), emb.sin().to(self.dtype).to(dev)

    def _has_kv(self, layer: int) -> bool:
        return self.w.dims.layer_types[layer] == "full_attention"

    def load_states(self, cache, rows: int, src_rows: torch.Tensor | None = None) -> None:
        """Copy the prefill's conv and recurrent states (transformers' cache) into rows ``:rows``; zero the rest.
        ``src_rows`` [rows]: the prefill row each row copies (rows that share a prompt; None: its own)."""
        for i, layer in enumerate(cache.layers):
            if self.conv_states[i] is None:
                continue
            for dst, src in ((self.conv_states[i], layer.conv_states[0]),
                             (self.recurrent_states[i], layer.recurrent_states[0])):  # fmt: skip
                dst[:rows].copy_(src if src_rows is None else src[src_rows])
                dst[rows:].zero_()

    # -- the mixers -------------------------------------------------------------------------------------------

    def _full_attention(self, xn, lw: HybridLayerWeights, i: int, lengths) -> torch.Tensor:
        d, B = self.dims, self.batch
        dec, A = kernels().ops, kernels().attention
        D, Hq, Hkv = d.head_dim, d.num_heads, d.num_kv_heads
        proj = dec.linear(xn, lw.w_in)  # [q | k | v | output gate]
        c = self.caches[i]
        # q/k RMSNorm and partial RoPE rounded as transformers' ops round them, K/V stored
        q = A.qkv_post(proj, c, self.positions, Hq, Hkv, lw.q_norm, lw.k_norm, self.cos, self.sin, d.eps,
                       round_like_torch=True)  # fmt: skip
        attn = A.decode_attention(q, c, lengths, splits=self.splits)
        gate = proj[:, (Hq + 2 * Hkv) * D :]
        return dec.linear(attn.reshape(B, -1) * torch.sigmoid(gate), lw.w_out)

    def _linear_attention(self, xn, lw: HybridLayerWeights, i: int) -> torch.Tensor:
        d, B = self.dims, self.batch
        dec = kernels().ops
        Hk, Hv, Dk, Dv = d.lin_k_heads, d.lin_v_heads, d.lin_k_dim, d.lin_v_dim
        proj = dec.linear(xn, lw.w_in)
        if self.delta_rule == "triton":
            gated_delta = kernels().gated_delta
            qkv = gated_delta.causal_conv_step(proj, self.conv_states[i], lw.conv, (Hk, Dk, Hv, Dv))
            h = gated_delta.gated_delta_step(self.recurrent_states[i], qkv, proj, lw.a_log, lw.dt_bias, lw.gate_norm,
                                             d.eps, Hk)  # fmt: skip
            return dec.linear(h, lw.w_out)
        mixed, z, b, a = proj.split([d.conv_dim, Hv * Dv, Hv, Hv], -1)
        # causal conv1d: shift the window of the last `kernel` inputs, one depthwise product over it, SiLU
        st = self.conv_states[i]
        st.copy_(torch.cat([st[:, :, 1:], mixed.unsqueeze(-1).to(st.dtype)], -1))
        x = F.silu(F.conv1d(st.to(lw.conv.dtype), lw.conv.unsqueeze(1), groups=d.conv_dim)).squeeze(-1).to(xn.dtype)
        q, k, v = x.split([Hk * Dk, Hk * Dk, Hv * Dv], -1)
        q, k = _l2norm(q.view(B, Hk, Dk).float()), _l2norm(k.view(B, Hk, Dk).float())
        q = q / Dk**0.5
        beta = torch.sigmoid(b).float()
        g = -lw.a_log.float().exp() * F.softplus(a.float() + lw.dt_bias)
        S = self.recurrent_states[i]
        if Hv != Hk:
            q, k = q.repeat_interleave(Hv // Hk, 1), k.repeat_interleave(Hv // Hk, 1)
        # the gated delta rule, one token: S <- exp(g) S;  S += k (beta (v - S^T k))^T;  out = S^T q. In place and
        # with matrix-vector products, so the [B, Hv, Dk, Dv] state is read 4 times and written twice, no temporaries.
        S.mul_(g.exp()[..., None, None])
        Sf = S.view(B * Hv, Dk, Dv)
        kv_mem = torch.bmm(k.reshape(B * Hv, 1, Dk), Sf).view(B, Hv, Dv)
        delta = (v.view(B, Hv, Dv).float() - kv_mem) * beta[..., None]
        S.addcmul_(k[..., None], delta[:, :, None, :])
        out = torch.bmm(q.reshape(B * Hv, 1, Dk), Sf).view(B, Hv, Dv).to(xn.dtype)
        return self._gated_norm_out(out, z, lw)

    def _gated_norm_out(self, out, z, lw: HybridLayerWeights) -> torch.Tensor:
        """Gated RMSNorm (norm, weight, then * silu(z)) per value head, and the output projection."""
        d, B = self.dims, self.batch
        Hv, Dv = d.lin_v_heads, d.lin_v_dim
        dec = kernels().ops
        h = out.float()
        h = lw.gate_norm * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + d.eps)).to(out.dtype)
        h = (h * F.silu(z.reshape(B, Hv, Dv).float())).to(out.dtype)
        return dec.linear(h.reshape(B, -1), lw.w_out)

    def _shared_expert(self, xn, lw: HybridLayerWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared expert's output and its gate logit: the next norm adds ``sigmoid(gate) * out``."""
        dec = kernels().ops
        S = self.dims.shared_dim
        proj = dec.linear(xn, lw.w_shared)  # [gate | up | shared_expert_gate | zeros]
        return dec.linear(dec.silu_mul(proj, S), lw.w_shared_down), proj[:, 2 * S]

    # -- the step ---------------------------------------------------------------------------------------------

    def step(self) -> None:
        """One decode step on the static buffers (no host synchronization, so it can be graph-captured)."""
        d = self.dims
        dec, moe = kernels().ops, kernels().moe
        res = F.embedding(self.tokens, self.w.embed)
        lengths = self.positions + 1
        pending, shared = None, None  # the last layer's routed slots, and its shared expert (output, gate logit)
        for i, lw in enumerate(self.w.layers):
            xn = dec.add_rmsnorm(res, pending, lw.ln_in, d.eps, round_normalized=self.round_normalized, gated=shared)
            if lw.kind == "full_attention":
                o = self._full_attention(xn, lw, i, lengths)
            else:
                o = self._linear_attention(xn, lw, i)
            if self.fp4_experts:
                xn, xq = self._add_rmsnorm_fp4(res, o.unsqueeze(1), lw.ln_post, i)
            else:
                xn = xq = dec.add_rmsnorm(
                    res, o.unsqueeze(1), lw.ln_post, d.eps, round_normalized=self.round_normalized
                )
            ids, tw = dec.router_topk(dec.linear(xn, lw.w_router), d.top_k, d.norm_topk_prob)
            if self.record_routing:
                self.routing[i].copy_(ids)
            if self.record_hints and i in self.hidden_hinted:
                pending = self._experts_recording_hidden(xq, ids, tw, i)
            else:
                pending = moe.experts_from_quantized(xq, ids, tw, lw.gate_up, lw.down, hidden_fp4=self.fp4_experts)
            shared = self._shared_expert(xn, lw)
        xn = dec.add_rmsnorm(res, pending, self.w.norm, d.eps, round_normalized=self.round_normalized, gated=shared)
        self._next_token(xn)


__all__ = ["HybridDims", "HybridLayerWeights", "HybridDecodeWeights", "HybridDecoder", "pad_rows"]
