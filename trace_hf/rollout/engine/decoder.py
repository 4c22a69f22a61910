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

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ... import fp4
from ...fp4 import FP4Tensor
from .kernels import kernels


# ----------------------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Dims:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_dim: int
    vocab: int
    num_layers: int
    eps: float = 1e-6
    rope_theta: float = 1e6
    norm_topk_prob: bool = True

    @classmethod
    def qwen3_30b_a3b(cls, num_layers: int = 48) -> Dims:
        return cls(2048, 32, 4, 128, 128, 8, 768, 151936, num_layers)

    @classmethod
    def from_config(cls, config) -> Dims:
        c = config.get_text_config(decoder=True)
        if getattr(c, "mlp_only_layers", None) or getattr(c, "decoder_sparse_step", 1) != 1:
            raise ValueError("fast_decode handles Qwen3 MoE models whose every layer is MoE.")
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"fast_decode implements default RoPE, not {rope.get('rope_type')!r}.")
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, head_dim, c.num_experts,
            c.num_experts_per_tok, c.moe_intermediate_size, c.vocab_size, c.num_hidden_layers, c.rms_norm_eps,
            float(theta), bool(getattr(c, "norm_topk_prob", True)),
        )  # fmt: skip


@dataclass
class LayerWeights:
    ln_in: torch.Tensor
    w_qkv: torch.Tensor  # [(Hq + 2 Hkv) * D, H]
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    w_o: torch.Tensor
    ln_post: torch.Tensor
    w_router: torch.Tensor  # [E, H]
    gate_up: FP4Tensor | torch.Tensor  # [E, 2I, H]
    down: FP4Tensor | torch.Tensor  # [E, H, I]
    hinted: bool = False
    hint_sites: tuple[str, ...] = ("experts_input",)  # what a hinted layer records (`TraceFP4Config.hint_sites`)

    def nbytes_dense(self) -> int:
        ts = (self.ln_in, self.w_qkv, self.q_norm, self.k_norm, self.w_o, self.ln_post, self.w_router)
        return sum(t.numel() * t.element_size() for t in ts)


@dataclass
class DecodeWeights:
    dims: Dims
    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor
    layers: list[LayerWeights] = field(default_factory=list)

    @property
    def fp4_experts(self) -> bool:
        return isinstance(self.layers[0].gate_up, FP4Tensor)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def num_kv_layers(self) -> int:
        """Layers with a K/V cache."""
        return self.dims.num_layers

    def state_bytes_per_row(self) -> int:
        """Bytes of per-sequence state other than the K/V cache (none for Qwen3)."""
        return 0

    def expert_bytes(self) -> int:
        """Bytes of one expert (gate_up + down) as stored."""
        lw = self.layers[0]
        E = self.dims.num_experts
        if isinstance(lw.gate_up, FP4Tensor):
            return (lw.gate_up.nbytes() + lw.down.nbytes()) // E
        return (lw.gate_up.numel() * lw.gate_up.element_size() + lw.down.numel() * lw.down.element_size()) // E


def quantize_experts(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[FP4Tensor, FP4Tensor]:
    """NVFP4 expert weights with one global scale per expert, as `TraceFP4Experts.packed_weights`."""
    with torch.no_grad():
        return fp4.quantize(gate_up, "nvfp4", "expert"), fp4.quantize(down, "nvfp4", "expert")


def weights_from_hf(model, fp4_experts: bool | None = None) -> DecodeWeights:
    """Take the weights of a transformers Qwen3 MoE causal LM (plain, or loaded with `TraceFP4Config`).

    FP4 experts (`TraceFP4Experts`) give their cached packed weights and hinted flags; plain experts stay dense
    unless ``fp4_experts=True`` (then they are quantized here, and the last half of the layers is hinted).
    """
    from ...experts import TraceFP4Experts

    dims = Dims.from_config(model.config)
    inner = model.model
    layers = []
    n = dims.num_layers
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.q_proj.bias is not None:
            raise ValueError("fast_decode does not handle attention biases.")
        w_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
        ex = mlp.experts
        if isinstance(ex, TraceFP4Experts):
            if ex.fmt != "nvfp4" or ex.activations != "fp4":
                raise ValueError("fast_decode's FP4 experts are NVFP4 W4A4 (TraceFP4Config defaults).")
            gu, d = ex.packed_weights()
            hinted, sites = ex.hinted, ex.hint_sites or ("experts_input",)
        elif fp4_experts:
            gu, d = quantize_experts(ex.gate_up_proj.detach(), ex.down_proj.detach())
            hinted, sites = i >= n - (n + 1) // 2, ("experts_input",)
        else:
            gu, d, hinted, sites = ex.gate_up_proj.detach(), ex.down_proj.detach(), False, ()
        layers.append(
            LayerWeights(
                layer.input_layernorm.weight.detach(),
                w_qkv,
                attn.q_norm.weight.detach(),
                attn.k_norm.weight.detach(),
                attn.o_proj.weight.detach(),
                layer.post_attention_layernorm.weight.detach(),
                mlp.gate.weight.detach(),
                gu,
                d,
                hinted,
                sites,
            )  # fmt: skip
        )
    return DecodeWeights(dims, inner.embed_tokens.weight.detach(), inner.norm.weight.detach(),
                         model.lm_head.weight.detach(), layers)  # fmt: skip


def experts_moved(experts, layers) -> bool:
    """Whether a refresh left any FP4 experts module holding packed tensors other than the ones these decode weights
    point at (it had to reallocate them): then the weights are rebuilt and the captured graphs dropped."""
    for ex, lw in zip(experts, layers, strict=False):
        gate_up, down = ex.packed_weights()
        if gate_up is not lw.gate_up or down is not lw.down:
            return True
    return False


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
    `logits` [B, V] the step's logits.
    """

    #: The norms round the normalized value to the model dtype before the weight (Qwen3's RMSNorm; `add_rmsnorm`).
    round_normalized = True

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
        hopper = A.uses_hopper_kernel(kv_fp4, d.head_dim, self.device)
        self.splits = A.num_splits(batch, d.num_kv_heads, max_len, hopper)
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self.logits = torch.zeros(batch, d.vocab, dtype=torch.float32, device=self.device)
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
        logits = F.linear(xn, self.w.lm_head)
        self.logits.copy_(logits)
        if self.sample is None:
            self.tokens.copy_(torch.argmax(logits, dim=-1))
        else:
            self.sample(self)
        self.positions.add_(1)

    # -- graph ----------------------------------------------------------------------------------------------

    def capture(self, warmup: int = 2) -> None:
        """Capture `step` in a CUDA graph (after ``warmup`` eager steps, which compile the kernels; the token
        and position buffers are restored afterwards)."""
        tokens, positions = self.tokens.clone(), self.positions.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warmup):
                self.step()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        torch.cuda.synchronize()

    def run(self) -> None:
        """One step: graph replay when captured, else eager."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step()

    # -- content --------------------------------------------------------------------------------------------


__all__ = [
    "Dims",
    "LayerWeights",
    "DecodeWeights",
    "FastDecoder",
    "weights_from_hf",
    "quantize_experts",
    "rope_tables",
]
