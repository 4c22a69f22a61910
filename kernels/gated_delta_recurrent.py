# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Gated DeltaNet's recurrent rule over whole sequences: the values of training forwards under
``TraceGRPOConfig(gated_delta_rule="recurrent")`` (`trace_hf.train.delta_rule`) in one launch per layer call.

Why: transformers' torch recurrent rule is a Python loop over tokens of about ten launches each, so a 1,152-token
micro-batch costs some 11K launches per layer, which made the recurrent values too slow to be worth their lower
rollout/training mismatch. Here one program per (row, value head, slice of value columns) keeps its [Dk, BV] slice of
the fp32 state in registers for the whole sequence and makes one pass over it per token.

The inputs are prepared by transformers' own torch ops (head repetition, the q/k L2 norms, q's 1/sqrt(Dk), the
decay's ``exp``), and the state update is the engine's decode step's (`gated_delta._delta_rule_kernel`, with the
same value-column slices, ``gated_delta.CONFIG["block_v"]``): so the values are transformers' torch rule's up to the
fp32 summation order of the two sums over Dk, as the engine's decode step's are.
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.gated_delta_recurrent (see kernels/README.md), not kernels.*.")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trace_hf.kernels.common import check_device  # noqa: E402
from trace_hf.kernels.gated_delta import CONFIG as STEP_CONFIG  # noqa: E402


#: Warps per program: the [Dk, BV] state slice stays in registers for the whole sequence (128 x 64 fp32 at
#: Qwen3.5's shape: 64 registers a thread at 4 warps, 128 at the decode step's 2).
CONFIG = {"num_warps": 4}


@triton.jit
def _row_offsets(len_ptr, bh, H, C: tl.constexpr):
    # Row b = bh // H of right-padded rows of len_ptr's lengths: its length n, and where head h of it starts in the
    # per-row layouts of `RecurrentRule.backward`: its checkpoints (rows' ceil(n / C) each, H heads a row) and its
    # tokens (rows' n each, H heads a row).
    b = bh // H
    h = bh % H
    n = tl.load(len_ptr + b)
    chunks = bh * 0  # int64 sums over the rows before b
    tokens = bh * 0
    for i in range(b):
        m = tl.load(len_ptr + i).to(tl.int64)
        chunks += (m + C - 1) // C
        tokens += m
    return n, H * chunks + h * ((n.to(tl.int64) + C - 1) // C), H * tokens + h * n.to(tl.int64)


@triton.jit(do_not_specialize=["T", "NC"])  # token counts: see kernels/README.md
def _recurrent_rule_kernel(q_ptr, k_ptr, v_ptr, decay_ptr, beta_ptr, s_ptr, o_ptr, ckpt_ptr, len_ptr, H, T, NC,
                           DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                           HAS_STATE: tl.constexpr, KEEP_STATE: tl.constexpr, CHECKPOINTS: tl.constexpr,
                           HAS_LENGTHS: tl.constexpr):  # fmt: skip
    # q, k [B * H, T, DK], v and o [B * H, T, DV], decay and beta [B * H, T], all fp32 contiguous; state [B * H, DK, DV].
    # With CHECKPOINTS, the state before every C-th token goes to ckpt [B * H * NC, DK, DV] (for `_backward_kernel`).
    # With HAS_LENGTHS, row b steps its first len[b] tokens only (right padding after them: o is left as it was), and
    # the checkpoints are laid out per row (`_row_offsets`: [sum over rows of H * ceil(len / C), DK, DV]).
    bh = tl.program_id(0).to(tl.int64)
    n = T
    ck0 = bh * NC
    if HAS_LENGTHS:
        n, ck0, _ = _row_offsets(len_ptr, bh, H, C)
    dk = tl.arange(0, DK)
    dv = tl.program_id(1) * BV + tl.arange(0, BV)
    at = s_ptr + bh * (DK * DV) + dk[:, None] * DV + dv[None, :]
    if HAS_STATE:
        s = tl.load(at)
    else:
        s = tl.zeros((DK, BV), dtype=tl.float32)
    for t in range(n):
        if CHECKPOINTS:  # noqa: SIM102 (a compile-time branch: the values-only kernel has no test per token)
            if t % C == 0:
                tl.store(ckpt_ptr + (ck0 + t // C) * (DK * DV) + dk[:, None] * DV + dv[None, :], s)
        row = bh * T + t
        q = tl.load(q_ptr + row * DK + dk)
        k = tl.load(k_ptr + row * DK + dk)
        v = tl.load(v_ptr + row * DV + dv)
        s = s * tl.load(decay_ptr + row)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * tl.load(beta_ptr + row)
        s = s + k[:, None] * delta[None, :]
        tl.store(o_ptr + row * DV + dv, tl.sum(s * q[:, None], axis=0))
    if KEEP_STATE:
        tl.store(at, s)


@triton.jit(do_not_specialize=["T", "NC", "NT"])  # token counts: see kernels/README.md
def _backward_kernel(q_ptr, k_ptr, v_ptr, decay_ptr, beta_ptr, do_ptr, ckpt_ptr, dq_ptr, dk_ptr, dv_ptr, ddecay_ptr,
                     dbeta_ptr, len_ptr, H, T, NC, NT, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                     C: tl.constexpr, HAS_LENGTHS: tl.constexpr):  # fmt: skip
    # The recurrence's exact gradient, back through the tokens: the state before each token is rebuilt from the
    # checkpoint of its chunk of C tokens (O(T * C / 2) state steps, no per-token state in memory). One program per
    # (row and head, BV value columns); dq, dk, ddecay, dbeta are this slice's parts ([DV / BV, NT, ...] over NT =
    # B * H * T token slots), summed by the caller; dv [B * H, T, DV] is whole. With HAS_LENGTHS, row b's first
    # len[b] tokens only (dv past them is left as it was: zeros from the caller), and the checkpoints and the parts
    # are laid out per row (`_row_offsets`; NT = H * sum(len)), so the padding takes no memory.
    bh = tl.program_id(0).to(tl.int64)
    n = T
    ck0 = bh * NC
    tk0 = bh * T
    if HAS_LENGTHS:
        n, ck0, tk0 = _row_offsets(len_ptr, bh, H, C)
    part = tl.program_id(1).to(tl.int64)
    parts_at = part * NT + tk0  # this slice's part, this row and head's first token slot
    dk = tl.arange(0, DK)
    dv = part * BV + tl.arange(0, BV)
    ds = tl.zeros((DK, BV), dtype=tl.float32)  # dL/d(state after the token being processed)
    nc = (n + C - 1) // C
    for i in range(nc):
        c = nc - 1 - i
        t0 = c * C
        t1 = tl.minimum(t0 + C, n)
        for j in range(t1 - t0):
            t = t1 - 1 - j
            s = tl.load(ckpt_ptr + (ck0 + c) * (DK * DV) + dk[:, None] * DV + dv[None, :])
            for u in range(t0, t):  # the state before token t
                r = bh * T + u
                ku = tl.load(k_ptr + r * DK + dk)
                s = s * tl.load(decay_ptr + r)
                du = (tl.load(v_ptr + r * DV + dv) - tl.sum(s * ku[:, None], axis=0)) * tl.load(beta_ptr + r)
                s = s + ku[:, None] * du[None, :]
            row = bh * T + t
            slot = parts_at + t
            q = tl.load(q_ptr + row * DK + dk)
            k = tl.load(k_ptr + row * DK + dk)
            v = tl.load(v_ptr + row * DV + dv)
            g = tl.load(decay_ptr + row)
            b = tl.load(beta_ptr + row)
            do = tl.load(do_ptr + row * DV + dv)
            sp = s * g
            m = tl.sum(sp * k[:, None], axis=0)
            delta = (v - m) * b
            st = sp + k[:, None] * delta[None, :]
            # o = st^T q
            dq = tl.sum(st * do[None, :], axis=1)
            ds = ds + q[:, None] * do[None, :]
            # st = sp + k delta^T
            ddelta = tl.sum(ds * k[:, None], axis=0)
            dkt = tl.sum(ds * delta[None, :], axis=1)
            # delta = b (v - m)
            dm = -b * ddelta
            dkt += tl.sum(sp * dm[None, :], axis=1)
            # m = sp^T k; sp = g s
            ds = ds + k[:, None] * dm[None, :]
            tl.store(ddecay_ptr + slot, tl.sum(tl.sum(ds * s, axis=1), axis=0))
            ds = ds * g
            tl.store(dv_ptr + row * DV + dv, b * ddelta)
            tl.store(dbeta_ptr + slot, tl.sum(ddelta * (v - m), axis=0))
            tl.store(dq_ptr + slot * DK + dk, dq)
            tl.store(dk_ptr + slot * DK + dk, dkt)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)  # transformers' (and fla's) l2norm


def _forward(q, k, v, decay, beta, state=None, keep_state=False, ckpt=None, chunk=1, lengths=None):
    """Launch `_recurrent_rule_kernel` on prepared [B * H, T, ...] fp32 inputs: the output [B * H, T, Dv]; ``state``
    [B * H, Dk, Dv] is read (if given) and, with ``keep_state``, overwritten by the final state (with ``lengths``,
    int32 [B], the state after row b's first lengths[b] tokens; the output past them is zero)."""
    BH, T, dk = k.shape
    dv = v.shape[-1]
    out = torch.empty_like(v) if lengths is None else torch.zeros_like(v)
    bv = min(STEP_CONFIG["block_v"], dv)
    nc = 0 if ckpt is None else -(-T // chunk)
    heads = BH if lengths is None else BH // lengths.shape[0]
    _recurrent_rule_kernel[(BH, dv // bv)](q, k, v, decay, beta, out if state is None else state, out,
                                           out if ckpt is None else ckpt, out if lengths is None else lengths, heads,
                                           T, nc, DK=dk, DV=dv, BV=bv, C=chunk, HAS_STATE=state is not None,
                                           KEEP_STATE=keep_state, CHECKPOINTS=ckpt is not None,
                                           HAS_LENGTHS=lengths is not None, num_warps=CONFIG["num_warps"],
                                           enable_fp_fusion=True)  # fmt: skip
    return out


#: The backward's settings: the state is kept every ``chunk`` tokens (T / chunk states of [Dk, Dv] fp32 per row and
#: head, while backward runs) and rebuilt in between (about T * chunk / 2 state steps); ``block_v`` value columns per
#: program (four [Dk, block_v] fp32 tiles live at once). The fastest of 27 settings on an H100 with chunk >= 16
#: (`benchmarks.kernels.gated_delta_backward`, docs/runs/h100_129/gdr_bwd.json); chunk 8 was 1.14x faster, with twice
#: the checkpoints.
BACKWARD = {"chunk": 16, "block_v": 16, "num_warps": 1}


class RecurrentRule(torch.autograd.Function):
    """The recurrent rule on prepared [B * H, T, ...] fp32 inputs (q normalized and scaled, decay = exp(g)), from a
    zero state: forward `_recurrent_rule_kernel`, backward `_backward_kernel`, the recurrence's own gradient (no
    per-token state is saved: backward rebuilds it from checkpoints it writes first). Returns the output and, with
    ``keep_state``, the final state (for a cache; no gradient flows through it), else None. ``lengths`` (int32 [B]
    or None): each row's tokens before its right padding, the only ones stepped (the output past them is zero)."""

    @staticmethod
    def forward(ctx, q, k, v, decay, beta, keep_state, lengths=None):
        ctx.save_for_backward(q, k, v, decay, beta, lengths)
        if not keep_state:
            return _forward(q, k, v, decay, beta, lengths=lengths), None
        state = torch.zeros(k.shape[0], k.shape[-1], v.shape[-1], dtype=torch.float32, device=v.device)
        out = _forward(q, k, v, decay, beta, state=state, keep_state=True, lengths=lengths)
        ctx.mark_non_differentiable(state)
        return out, state

    @staticmethod
    def backward(ctx, do, _):
        q, k, v, decay, beta, lengths = ctx.saved_tensors
        BH, T, dk = k.shape
        dv = v.shape[-1]
        chunk = BACKWARD["chunk"]
        bv = min(BACKWARD["block_v"], dv)
        parts = dv // bv
        fp32 = {"dtype": torch.float32, "device": v.device}
        if lengths is None:
            heads, states, slots = BH, BH * -(-T // chunk), BH * T
        else:  # laid out per row: checkpoints and parts for each row's own tokens (one sync for the sizes)
            heads = BH // lengths.shape[0]
            host = lengths.tolist()
            states, slots = heads * sum(-(-n // chunk) for n in host), heads * sum(host)
        ckpt = torch.empty(states, dk, dv, **fp32)
        _forward(q, k, v, decay, beta, ckpt=ckpt, chunk=chunk, lengths=lengths)
        dq, dkk = (torch.empty(parts, slots, dk, **fp32) for _ in range(2))
        ddecay, dbeta = (torch.empty(parts, slots, **fp32) for _ in range(2))
        dvv = (torch.empty if lengths is None else torch.zeros)(v.shape, **fp32)  # past a row's length: zeros
        _backward_kernel[(BH, parts)](q, k, v, decay, beta, do.contiguous(), ckpt, dq, dkk, dvv, ddecay, dbeta,
                                      ckpt if lengths is None else lengths, heads, T, -(-T // chunk), slots, DK=dk,
                                      DV=dv, BV=bv, C=chunk, HAS_LENGTHS=lengths is not None,
                                      num_warps=BACKWARD["num_warps"], enable_fp_fusion=True)  # fmt: skip
        grads = [x.sum(0) for x in (dq, dkk, ddecay, dbeta)]
        if lengths is None:
            grads = [x.view(BH, T, *x.shape[1:]) for x in grads]
        else:  # each row's tokens back to their padded places
            at = _padded_slots(lengths, heads, T, slots)
            grads = [torch.zeros(BH * T, *x.shape[1:], **fp32).index_copy_(0, at, x).view(BH, T, *x.shape[1:])
                     for x in grads]  # fmt: skip
        dq, dkk, ddecay, dbeta = grads
        return dq, dkk, dvv, ddecay, dbeta, None, None


def _padded_slots(lengths: torch.Tensor, heads: int, T: int, slots: int) -> torch.Tensor:
    """Where each token slot of the per-row layout (rows in order, ``heads`` heads a row, each head's first
    lengths[row] tokens) sits in the padded [B * heads * T] layout; computed on the device (no host sync)."""
    per = lengths.long().repeat_interleave(heads)  # tokens of each (row, head)
    first = torch.cumsum(per, 0) - per
    bh = torch.repeat_interleave(torch.arange(per.shape[0], device=per.device), per, output_size=slots)
    return bh * T + torch.arange(slots, device=per.device) - first[bh]


def recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, lengths=None, **kwargs):  # fmt: skip
    """transformers' ``torch_recurrent_gated_delta_rule`` (same arguments: ``query``/``key`` [B, T, Hk, Dk],
    ``value`` [B, T, Hv, Dv], ``g`` (log decay) and ``beta`` [B, T, Hv]; same returns: the output [B, T, Hv, Dv] in
    the input's dtype and the final fp32 state [B, Hv, Dk, Dv] or None) with the loop over tokens in one launch.
    From no state it is differentiable (`RecurrentRule`; the final state, if kept, is not); from an initial state
    it computes values only.

    ``lengths`` (int [B], optional): row b's tokens are its first lengths[b], right-padded after them (a packed
    forward's rows, `trace_hf.train.packing`). Only those are stepped: the output past them is zero and takes no
    gradient, and the final state is the one after the row's last token. The padding then costs nothing."""
    check_device(query)
    dtype = query.dtype
    B, T, hk, dk = key.shape
    hv, dv = value.shape[-2:]
    if hv % hk or dk & (dk - 1) or dv & (dv - 1):
        raise ValueError(f"recurrent_gated_delta_rule: Dk and Dv must be powers of two and Hv a multiple of Hk; got "
                         f"Hk={hk}, Dk={dk}, Hv={hv}, Dv={dv}.")  # fmt: skip
    if (
        initial_state is not None
        and torch.is_grad_enabled()
        and any(t.requires_grad for t in (query, key, value, g, beta))
    ):
        raise NotImplementedError(
            "recurrent_gated_delta_rule has no gradient from an initial state; call it without one (training forwards "
            "start each row from zero) or under torch.no_grad()."
        )
    if hk != hv:
        query = query.repeat_interleave(hv // hk, dim=2)
        key = key.repeat_interleave(hv // hk, dim=2)
    # [B * H, T, ...] fp32, contiguous (`to` alone keeps an fp32 input's transposed strides)
    query, key, value, beta, g = (
        x.transpose(1, 2).to(torch.float32).contiguous() for x in (query, key, value, beta, g)
    )
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query / (dk**0.5)
    flat = [x.flatten(0, 1) for x in (query, key, value, g.exp(), beta)]
    if lengths is not None:
        if lengths.shape != (B,) or lengths.device != query.device:
            raise ValueError(f"recurrent_gated_delta_rule: lengths must be [B] = [{B}] on {query.device}; got "
                             f"{tuple(lengths.shape)} on {lengths.device}.")  # fmt: skip
        lengths = lengths.to(torch.int32).clamp(0, T).contiguous()
    if initial_state is None:
        out, state = RecurrentRule.apply(*flat, output_final_state, lengths)
    else:
        state = initial_state.reshape(B * hv, dk, dv).to(torch.float32, copy=True).contiguous()
        out = _forward(*flat, state=state, keep_state=output_final_state, lengths=lengths)
    state = state.view(B, hv, dk, dv) if output_final_state else None
    return out.view(B, hv, T, dv).transpose(1, 2).contiguous().to(dtype), state
