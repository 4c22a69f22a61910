# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Routed experts with packed NVFP4 weights (W4A4), for rollout decode and prefill: the entry points, the dispatcher
over the four backends, and the torch reference.

Backends, one module each (their kernels and their launch), picked per call by `fp4_moe_configs`:
`fp4_moe_triton` (every GPU and the interpreter; also W4A16 and dense BF16), `fp4_moe_hopper` (Gluon decode
kernels, sm_90+), `fp4_moe_wgmma` (wgmma, many tokens per expert, sm_90+), `fp4_moe_grouped` (decoded operands and
grouped GEMMs, hundreds of tokens per expert); `fp4_moe_common` holds the steps they share.

Hopper has no FP4 tensor cores, so the speed comes from bytes: the kernels stream packed E2M1 codes (half a
byte per weight) plus E4M3 block scales, decode them in registers to exact operands (``E2M1 * s`` has at most
6 significant bits, so it is exact in bf16) and accumulate in fp32 with ``tl.dot``; the fp32 global scales
(``g_x`` per token row, ``g_w`` per expert) are applied once in the epilogue.

Pipeline of `fp4_moe_experts` (the same function as `TraceFP4Experts`' eval path, computed numerically, not bit
for bit: the dot products sum in another order than torch's matmul, so the hidden activation can differ in its
last fp32 bits and, rarely, round to a neighbouring FP4 code):

1. the input ``x`` is quantized per token (NVFP4 row scale) by `trace_hf.kernels.fp4_quant.quantize`, which
   also gives the hints of the token in the same pass (the decode step does it in its RMSNorm kernel,
   `decode_ops.add_rmsnorm_fp4`, and calls `experts_from_quantized`);
2. `moe_align`: (token, slot) pairs sorted by expert, each expert's segment padded to ``BLOCK_M`` rows (as
   vLLM's ``moe_align_block_size``), so every row block of the GEMMs belongs to one expert;
3. gate/up (`fp4_moe_triton._gate_up_kernel`): gate and up projections of a row block in one pass over the input, then SiLU(gate) * up
   (with ``split_k`` > 1, each program covers a slice of K and `fp4_moe_common.down_input` sums the slices in order);
4. the hidden activation is quantized per (token, expert) row, exactly as ``fp4.quantize(h, "nvfp4", "row")`` (with
   split-K in the same launch as the partial sums, `fp4_moe_common.down_input`);
5. down (`fp4_moe_triton._down_kernel`): down projection, times the routing weight, written per slot; the caller sums the top-k
   slots of a token (the decode step fuses that sum into its next RMSNorm).

On sm_90+ (measured on the H200) W4A4 decode calls run steps 3 and 5 in the Gluon kernels of `fp4_moe_hopper`
instead (`HOPPER`; same inputs and outputs, no layout shuffle before the MMA), and past its last limit or from 16 slots
per expert (prefill, training forwards, decode from batch 129 at top-8 of 128 experts), the wgmma kernels of `fp4_moe_wgmma`
(`WGMMA`: wide token blocks, each weight decoded once per block). Calls that ask for it (``bf16_sums=True``, the
opt-in `TraceFP4Config.prefill_bf16_gemms`) with hundreds of tokens per expert take `fp4_moe_grouped` (`GROUPED`):
weights decoded once to exact bf16, torch's grouped GEMM, the same epilogues, GEMM sums rounded to bf16
(`moe_experts_reference(..., gemm_dtype=torch.bfloat16)`). With ``GROUPED["fp32_sums"]`` the other calls of that size
take it too, through Triton's grouped GEMM (`fp4_moe_grouped._grouped_gemm_kernel`) with fp32 sums: the wgmma
kernels' function.
The Triton kernels also take dense (BF16) weights and activations (``W_FP4=False`` / ``A_FP4=False``): the BF16
baseline of the rollout benchmark runs the same code and differs only in the bytes it reads.

Dot operands: for W4A4 on the GPU, fp16 from the inline-PTX decoding `fp4_halves_f16` (exact; both operands
carry 2^-14, taken off the accumulator); otherwise bf16 on the GPU, and fp32 under ``TRITON_INTERPRET=1``, where
bf16 ``tl.dot`` is wrong (bf16 is raw uint16 there) and PTX does not run, with ``input_precision="ieee"``.
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.fp4_moe (see kernels/README.md), not kernels.fp4_moe.")

import torch  # noqa: E402

from trace_hf import fp4  # noqa: E402
from trace_hf.fp4 import FP4Tensor  # noqa: E402
from trace_hf.kernels import fp4_moe_grouped, fp4_moe_triton, fp4_quant  # noqa: E402
from trace_hf.kernels.common import check_device, gluon_module, hardware_fp8  # noqa: E402
from trace_hf.kernels.fp4_moe_common import QuantizedHidden, is_fp4  # noqa: E402
from trace_hf.kernels.fp4_moe_configs import (  # noqa: E402
    CONFIG,
    check_grouped_fp32,
    check_wgmma_entry,
    grouped_config,
    hopper_config,
    launch_config,
    wgmma_config,
)


__all__ = ["QuantizedHidden", "experts_from_quantized", "fp4_moe_experts", "moe_experts_reference"]


def experts_from_quantized(
    xq: FP4Tensor | torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: FP4Tensor | torch.Tensor,
    w_down: FP4Tensor | torch.Tensor,
    hidden_fp4: bool | None = None,
    align_backend: str = "auto",
    return_hidden: bool = False,
    reduce: bool = False,
    bf16_sums: bool = False,
):
    """Routed experts on an already quantized input (`FP4Tensor` [M, H], or a dense [M, H] tensor).

    Weights are `FP4Tensor` (NVFP4, per-expert global scale: ``[E, 2I, H]`` and ``[E, H, I]``) or dense tensors
    of those shapes. ``topk_ids`` must be < E (checking would cost a host sync): `TraceFP4Experts` maps
    expert-parallel sentinels to weight 0 before calling. ``hidden_fp4`` (default: whether the weights are FP4) quantizes the hidden activation per
    (token, expert) row. Returns fp32 ``[M, top_k * s, H]``: each slot's expert output times its routing weight, as
    ``s`` partial sums over slices of the intermediate dimension (``s = 1`` but where a `HOPPER` entry sets
    ``split_k_down``: batch 1); the token's output is the sum over dim 1; with ``reduce``, that sum, fp32
    ``[M, H]`` (fused into the grouped path's epilogue). With ``return_hidden`` (FP4 hidden only) also returns the `QuantizedHidden` the down projection
    read, for recording experts_hidden hints. ``bf16_sums=True`` lets a call of many tokens per expert take the
    grouped path (`GROUPED`: bf16 GEMMs, their sums rounded to bf16 before the epilogues, ~1.3x faster at a
    16K-token prefill); otherwise every GEMM sum stays fp32, as decode's (`TraceFP4Config.prefill_bf16_gemms`),
    on the grouped path too where ``GROUPED["fp32_sums"]`` is on (Triton's GEMMs on its decoded operands).
    """
    y, hidden = _experts(xq, topk_ids, topk_weights, w_gate_up, w_down, hidden_fp4, align_backend, return_hidden,
                         reduce, bf16_sums)  # fmt: skip
    if reduce and y.ndim == 3:
        y = y.sum(1)
    return (y, hidden) if return_hidden else y


def _experts(xq, topk_ids, topk_weights, w_gate_up, w_down, hidden_fp4, align_backend, return_hidden, reduce,
             bf16_sums):  # fmt: skip
    """`experts_from_quantized` by backend: (y, `QuantizedHidden` or None); y is [M, H] only from the grouped one."""
    a_fp4, w_fp4, wd_fp4 = (is_fp4(t) for t in (xq, w_gate_up, w_down))
    if wd_fp4 != w_fp4:
        raise ValueError("Give both expert weights packed (FP4Tensor) or both dense.")
    hidden_fp4 = w_fp4 if hidden_fp4 is None else hidden_fp4
    if return_hidden and not hidden_fp4:
        raise ValueError("return_hidden needs the FP4 hidden activation (hidden_fp4=True): a dense one has no hints.")
    x_arg = xq.packed if a_fp4 else xq
    check_device(x_arg)
    E, two_i, H = w_gate_up.shape
    NI = two_i // 2
    M, K = topk_ids.shape
    n = M * K
    dev = x_arg.device
    args = (xq, topk_ids, topk_weights, w_gate_up, w_down, align_backend, return_hidden)
    w4a4 = a_fp4 and w_fp4 and hidden_fp4
    grouped = grouped_config(n, E, dev) if w4a4 else None
    if grouped is not None and bf16_sums:
        return fp4_moe_grouped.experts_bf16(grouped, *args, reduce)
    if grouped is not None and grouped.get("fp32_sums") and check_grouped_fp32(grouped, H, NI):
        return fp4_moe_grouped.experts_fp32(grouped, *args)
    wgmma = wgmma_config(n, E, dev) if w4a4 else None
    if wgmma is not None and check_wgmma_entry(wgmma, H, NI):  # else shapes its tiles do not divide: decode kernels
        return gluon_module("fp4_moe_wgmma").experts(wgmma, *args)
    hopper = hopper_config(n, dev) if w4a4 else None
    if hopper is not None and not (H % hopper["block_k"] or NI % hopper["block_k"] or NI % hopper["block_n_gate_up"]
                                   or H % hopper["block_n_down"]):  # fmt: skip
        return gluon_module("fp4_moe_hopper").experts(hopper, *args)
    cfg = launch_config(n, w_fp4)  # the Triton kernels: every other call, shapes the Gluon tiles do not divide
    if not hardware_fp8(dev):
        cfg = dict(cfg, halves=False, ptx=False)
    bm = cfg.get("block_m", CONFIG["block_m"])
    return fp4_moe_triton.experts(cfg, bm, xq, topk_ids, topk_weights, w_gate_up, w_down, hidden_fp4, align_backend,
                                  return_hidden)  # fmt: skip


def fp4_moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: FP4Tensor,
    w_down: FP4Tensor,
    activations: str = "fp4",
    return_hints: bool = False,
):
    """`TraceFP4Experts`' eval path in Triton: ``x`` [M, H] -> [M, H] in ``x.dtype``.

    ``activations="fp4"`` quantizes the input per token and the hidden per (token, expert) row (W4A4);
    ``"none"`` keeps them dense (W4A16). With ``return_hints`` also returns the input's `FP4Hints` (written in the
    quantization pass), what `trace_hf.hints.HintRecorder` keeps.
    """
    hints = None
    if activations == "fp4":
        if return_hints:
            xq, hints = fp4_quant.quantize(x, "nvfp4", "row", return_hints=True)
        else:
            xq = fp4_quant.quantize(x, "nvfp4", "row")
    elif activations == "none":
        xq = x
    else:
        raise ValueError(f"activations={activations!r}: use 'fp4' or 'none'.")
    y = experts_from_quantized(xq, topk_ids, topk_weights, w_gate_up, w_down, hidden_fp4=activations == "fp4")
    out = y.sum(1).to(x.dtype)
    return (out, hints) if return_hints else out


def moe_experts_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: FP4Tensor | torch.Tensor,
    w_down: FP4Tensor | torch.Tensor,
    activations: str = "fp4",
    gemm_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The torch fallback and reference: the math of `trace_hf.quant.expert_paths.routed` (eval path), computed in fp32 by
    gathering each slot's expert weights (fine for tests and small batches, not fast). As in the kernels, a GEMM
    sums ``E2M1 * s`` products and its operands' global scales multiply the sum: the function of every kernel path
    with fp32 sums (the grouped one with ``GROUPED["fp32_sums"]`` included). ``gemm_dtype=torch.bfloat16``: each
    GEMM's sum is rounded to bf16 before the scales, the function of the grouped path with ``bf16_sums=True``."""
    xf = x.float()
    xg = 1.0
    if activations == "fp4":
        xf, xg = _exact_and_global(fp4.quantize(xf, "nvfp4", "row", backend="torch"))
    gu, gug = _exact_and_global(w_gate_up)
    d, dg = _exact_and_global(w_down)
    M, K = topk_ids.shape
    out = torch.zeros(M, x.shape[-1], dtype=torch.float32, device=x.device)
    for k in range(K):
        e = topk_ids[:, k].long()
        gate, up = (_round(torch.einsum("mh,mnh->mn", xf, gu[e]), gemm_dtype) * xg * gug[e]).chunk(2, dim=-1)
        h, hg = torch.nn.functional.silu(gate) * up, 1.0
        if activations == "fp4":
            h, hg = _exact_and_global(fp4.quantize(h, "nvfp4", "row", backend="torch"))
        out += _round(torch.einsum("mi,mhi->mh", h, d[e]), gemm_dtype) * hg * dg[e] * topk_weights[:, k, None].float()
    return out.to(x.dtype)


def _exact_and_global(q: FP4Tensor | torch.Tensor):
    """(``E2M1 * s`` in fp32, the global scale shaped to multiply a GEMM's output rows) of an `FP4Tensor`: an
    activation [M, K] gives [M, 1], expert weights [E, N, K] give [E, 1] (indexed by expert); (fp32, 1) if dense."""
    if not isinstance(q, FP4Tensor):
        return q.float(), torch.ones(q.shape[0], 1, device=q.device) if q.ndim == 3 else 1.0
    ones = torch.ones(q.packed.shape[:-1] + (1,), dtype=torch.float32, device=q.packed.device)
    exact = FP4Tensor(q.packed, q.block_scale, ones, q.fmt).dequantize()
    return exact, q.global_scale.float().reshape(q.shape[0], 1)


def _round(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None else t.to(dtype).float()
