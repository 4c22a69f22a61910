# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The decode weights: what a decoder step reads, and how the engine keeps them equal to the model's.

A family's layout map (`trace_hf.rollout.engine.layouts`) says, once, which model tensor fills which decode
weight: a parameter itself (the engine reads it in place), or a `Derived` tensor computed from parameters (a fused
projection, a ``1 + w`` norm, a LoRA-folded weight), which the engine owns and recomputes in place at every refresh.
The same map serves the three ways the engine reads a model: building the weights, refreshing them before each
rollout (`EngineWeights`), and under FSDP2 gathering full copies one layer at a time (`ShardedWeights`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ... import fp4, models
from ...fp4 import FP4Tensor
from ...quant.experts import TraceFP4Experts, fp4_experts


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
            raise ValueError("the engine handles Qwen3 MoE models whose every layer is MoE")
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"the engine implements default RoPE, not {rope.get('rope_type')!r}")
        return cls(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, models.head_dim(config), c.num_experts,
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


def experts_moved(experts, layers) -> bool:
    """Whether a refresh left any FP4 experts module holding packed tensors other than the ones these decode weights
    point at (it had to reallocate them): then the weights are rebuilt and the captured graphs dropped."""
    for ex, lw in zip(experts, layers, strict=False):
        gate_up, down = ex.packed_weights()
        if gate_up is not lw.gate_up or down is not lw.down:
            return True
    return False


@dataclass(frozen=True)
class Derived:
    """A decode tensor computed from parameters. ``make(full)`` computes it, applying ``full`` to each parameter it
    reads (the identity, or under FSDP2 the gather of anything still sharded)."""

    make: Callable[[Callable[[torch.Tensor], torch.Tensor]], torch.Tensor]


class Reader:
    """Turns a layout map's entries into decode tensors: a parameter in place, a `Derived` computed now and
    recomputed at every `refresh` (the engine's own copy)."""

    def __init__(self):
        self.derived: list[tuple[torch.Tensor, Derived]] = []

    @staticmethod
    def full(t: torch.Tensor) -> torch.Tensor:
        return t

    def tensor(self, x: torch.Tensor | Derived) -> torch.Tensor:
        if isinstance(x, Derived):
            t = x.make(self.full).detach()
            self.derived.append((t, x))
            return t
        return x.detach()

    def experts(self, ex: torch.nn.Module) -> tuple:
        """(gate_up, down, hinted, hint_sites) of an experts module: packed FP4 weights, or the dense masters."""
        if isinstance(ex, TraceFP4Experts):
            gu, d = ex.packed_weights()
            return gu, d, ex.hinted, ex.hint_sites or ("experts_input",)
        return self.tensor(ex.gate_up_proj), self.tensor(ex.down_proj), False, ()

    def gathered(self, modules):
        """Full parameters of these modules inside (nothing to gather here)."""
        return contextlib.nullcontext()

    def refresh(self) -> None:
        for t, x in self.derived:
            t.copy_(x.make(self.full))


def read_weights(lm, layout, reader: Reader) -> DecodeWeights:
    """The decode weights of a causal LM through its family's layout map (the root's tensors, then each layer's)."""
    inner = lm.model
    dims = layout.dims.from_config(lm.config)
    with reader.gathered([lm]):
        embed = reader.tensor(inner.embed_tokens.weight)
        norm = reader.tensor(layout.norm(inner.norm))
        head = reader.tensor(lm.lm_head.weight)
    layers = []
    for i, layer in enumerate(inner.layers):
        with reader.gathered(list(layer.modules())):
            layers.append(layout.read_layer(layout, layer, i, dims, reader))
    return layout.weights_type(dims, embed, norm, head, layers)


class EngineWeights:
    """The decode weights of one model, refreshed in place before each rollout: packed FP4 experts re-quantized from
    their masters, every `Derived` tensor recomputed; a parameter whose storage moved (reloaded) rebuilds all."""

    def __init__(self, lm, layout):
        self.lm, self.layout = lm, layout
        self.experts = fp4_experts(lm)
        self._build()

    def _build(self) -> None:
        self.reader = Reader()
        with torch.no_grad():
            self.w = read_weights(self.lm, self.layout, self.reader)
        self._ptrs = self._pointers()

    def _pointers(self) -> list[int]:
        return [p.data_ptr() for p in self.lm.parameters()]

    def refresh(self) -> bool:
        """Bring the weights up to date with the model; False if they had to be rebuilt (graphs are stale)."""
        with torch.no_grad():
            for ex in self.experts:
                ex.refresh_packed()
            if self._pointers() != self._ptrs or experts_moved(self.experts, self.w.layers):
                self._build()
                return False
            self.reader.refresh()
        return True


def sharded(lm) -> bool:
    """Whether FSDP2 (`fully_shard`) holds the parameters as DTensor shards."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in lm.parameters())


class _GatherReader(Reader):
    """FSDP2: every tensor an owned full copy (in the compute dtype), written into the previous copies on a refresh
    so that captured graphs keep reading the same storage; FP4 experts packed by their own modules from the gathered
    masters (frozen ones: their unsharded packed buffers)."""

    def __init__(self, dtype: torch.dtype, old: list[torch.Tensor] | None):
        super().__init__()
        self.dtype = dtype
        self.old = iter(old) if old is not None else None
        self.made: list[torch.Tensor] = []  # the copies, in the order the layout map reads them

    def full(self, t: torch.Tensor) -> torch.Tensor:  # anything unshard() left sharded: gather it
        return (t.full_tensor() if type(t).__name__ == "DTensor" else t).detach().to(self.dtype)

    def tensor(self, x: torch.Tensor | Derived) -> torch.Tensor:
        src = x.make(self.full) if isinstance(x, Derived) else self.full(x)
        t = src.clone() if self.old is None else next(self.old).copy_(src)
        self.made.append(t)
        return t

    def experts(self, ex: torch.nn.Module) -> tuple:
        if not isinstance(ex, TraceFP4Experts):
            return super().experts(ex)
        gu, d = ex.packed_weights() if ex.frozen else ex.pack_from(self.full(ex.gate_up_proj), self.full(ex.down_proj))
        return gu, d, ex.hinted, ex.hint_sites or ("experts_input",)

    @contextlib.contextmanager
    def gathered(self, modules):
        """Full parameters of these FSDP2 modules' own parameter groups inside (an all-gather each; collective:
        every rank must enter in the same order)."""
        from torch.distributed.fsdp import FSDPModule

        mods = [m for m in modules if isinstance(m, FSDPModule)]
        for m in mods:
            m.unshard()
        try:
            yield
        finally:
            for m in reversed(mods):
                m.reshard()


class ShardedWeights:
    """FSDP2: the engine owns full copies of the non-expert weights (and of the experts for the BF16 engine); FP4
    experts are packed by their own modules from the gathered masters. Each refresh gathers the root's parameters
    and then one decoder layer at a time, so no layer's full BF16 experts outlive its turn."""

    def __init__(self, lm, layout):
        self.lm, self.layout = lm, layout
        self.experts = fp4_experts(lm)
        self._copies: list[torch.Tensor] | None = None
        self.w = self._gather()

    def refresh(self) -> bool:
        self._gather()  # into the same copies: the first gather's weights stay valid
        return True

    def _gather(self) -> DecodeWeights:
        # The compute dtype: FSDP2 with mixed precision keeps fp32 shards and gathers them in the config's dtype.
        dtype = getattr(self.lm.config, "dtype", None)
        dtype = dtype if isinstance(dtype, torch.dtype) else next(self.lm.parameters()).dtype
        reader = _GatherReader(dtype, self._copies)
        with torch.no_grad():
            w = read_weights(self.lm, self.layout, reader)
        self._copies = reader.made
        return w


def engine_weights(lm, layout) -> EngineWeights | ShardedWeights:
    """The weight holder the engine keeps for a model: `ShardedWeights` under FSDP2, else `EngineWeights`."""
    return (ShardedWeights if sharded(lm) else EngineWeights)(lm, layout)
