# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Small fused kernels of the decode step: residual add + RMSNorm (optionally with the NVFP4 quantization of its
output, the experts' input, and a gated shared expert's output in the sum), the router's softmax + top-k, a dense
MLP's SiLU-and-multiply, a one-row GEMV for batch 1's projections, and the prefill's FP4 K/V copied into the decode
cache in one launch per layer (`load_fp4_kv`).

At decode sizes every elementwise torch op is its own launch that moves a few KB; a 48-layer step would be made
of thousands of them. These two kernels replace the ~15 launches per layer the plain torch code needs for the
norms and the router (the MoE's top-k slot sum is folded into the next norm's residual add).
"""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.decode_ops (see kernels/README.md), not kernels.decode_ops.")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trace_hf.fp4 import FP4Hints, FP4Tensor  # noqa: E402
from trace_hf.kernels.common import INTERPRETED  # noqa: E402
from trace_hf.kernels.fp4_quant import quantize_rows_nvfp4  # noqa: E402
from trace_hf.kernels.pdl import launch_options, wait_for_producer  # noqa: E402


@triton.jit
def _add_rmsnorm_kernel(res_ptr, add_ptr, w_ptr, out_ptr, q_ptr, sb_ptr, g_ptr, hb_ptr, y_ptr, gate_ptr, gate_stride,
                        H, eps, NADD: tl.constexpr, QUANT: tl.constexpr, WRITE_BITS: tl.constexpr, NBT: tl.constexpr,
                        PDL: tl.constexpr, ROUND_NORMED: tl.constexpr = True, GATED: tl.constexpr = False):  # fmt: skip
    wait_for_producer(PDL)
    # A row as [1, NBT, 16]: NVFP4 blocks of 16 along the last axis, the layout `quantize_rows_nvfp4` takes.
    r = tl.program_id(0).to(tl.int64)
    blks = tl.arange(0, NBT)
    h = (blks[:, None] * 16 + tl.arange(0, 16)[None, :])[None, :, :]
    m = h < H
    x = tl.load(res_ptr + r * H + h, mask=m, other=0.0).to(tl.float32)
    if NADD > 0:
        for j in tl.static_range(NADD):
            x += tl.load(add_ptr + (r * NADD + j) * H + h, mask=m, other=0.0).to(tl.float32)
        if GATED:  # a shared expert's output times sigmoid(its gate), each rounded as the model's ops round them
            dt = y_ptr.dtype.element_ty
            s = tl.load(gate_ptr + r * gate_stride).to(tl.float32)
            s = (1.0 / (1.0 + tl.exp(-s))).to(dt).to(tl.float32)
            x += (s * tl.load(y_ptr + r * H + h, mask=m, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        # The residual stream stays in the model dtype, as in the model: normalize the rounded value.
        x = x.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + r * H + h, x, mask=m)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(x * x, axis=2), axis=1) / H + eps)[:, None, None]
    y = x * rstd
    if ROUND_NORMED:
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    y = y * tl.load(w_ptr + h, mask=m, other=0.0).to(tl.float32)
    y = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r * H + h, y, mask=m)
    if QUANT:
        # The stored value, widened exactly: the codes are those of `quantize(out)`.
        quantize_rows_nvfp4(y.to(tl.float32), tl.full([1], 0, tl.int64) + r, tl.full([1], 1, tl.int1), blks, H, q_ptr, sb_ptr, g_ptr,
                            hb_ptr, WRITE_BITS, 1, NBT)  # fmt: skip


@triton.jit
def _router_topk_kernel(
    logits_ptr,
    ids_ptr,
    w_ptr,
    E,
    K: tl.constexpr,
    E_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producer(PDL)
    r = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    m = e < E
    lg = tl.load(logits_ptr + r * E + e, mask=m, other=float("-inf")).to(tl.float32)
    p = tl.exp(lg - tl.max(lg, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(m, p, -1.0)
    kk = tl.arange(0, K_PAD)
    vals = tl.zeros([K_PAD], tl.float32)
    idx = tl.zeros([K_PAD], tl.int32)
    for k in tl.static_range(K):
        mx = tl.max(p, axis=0)
        i = tl.min(tl.where(p == mx, e, E_PAD), axis=0)  # the lowest index among ties
        vals = tl.where(kk == k, mx, vals)
        idx = tl.where(kk == k, i, idx)
        p = tl.where(e == i, -2.0, p)
    if NORM:
        vals = vals / tl.sum(vals, axis=0)
    tl.store(ids_ptr + r * K + kk, idx, mask=kk < K)
    tl.store(w_ptr + r * K + kk, vals, mask=kk < K)


@triton.jit
def _x_tile(x_ptr, k, k_ok, BLOCK_N: tl.constexpr, X_BCAST: tl.constexpr):
    """x[k] in fp32 as a row to multiply the program's weight rows by. ``X_BCAST``: loaded in the weights' layout,
    each thread reading the x of its own weight columns (once per weight row it holds), with no shared-memory layout
    change and its two barriers per tile; else loaded once and broadcast (the same values either way)."""
    if X_BCAST:
        k2 = k[None, :] + tl.zeros([BLOCK_N, 1], tl.int32)
        return tl.load(x_ptr + k2, mask=k_ok[None, :], other=0.0).to(tl.float32)
    else:
        return tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                 EARLY: tl.constexpr = 0, X_BCAST: tl.constexpr = False):  # fmt: skip
    if EARLY == 0:  # first, as before the option (the same machine code)
        wait_for_producer(PDL)
    # out[n] = sum_k x[k] * w[n, k]: the products accumulate elementwise in fp32 over the K tiles in order and are
    # reduced once at the end, so the loop is 16-byte loads and FMAs (~4 instructions per weight on sm_90).
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    # EARLY: the first K tiles' weights are loaded before the PDL wait (the weights are constants; only x comes from
    # the previous kernel), so under PDL they stream while that kernel ends; then the same FMAs in the same order.
    tiles = ()
    for t in tl.static_range(EARLY):
        k_ok = (t * BLOCK_K + kk) < K
        tiles = tiles + (tl.load(w_rows + (t * BLOCK_K + kk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0),)
    if EARLY > 0:
        wait_for_producer(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    xs = ()  # all of their x tiles in flight at once, then the products
    for t in tl.static_range(EARLY):
        xs = xs + (_x_tile(x_ptr, t * BLOCK_K + kk, (t * BLOCK_K + kk) < K, BLOCK_N, X_BCAST),)
    for t in tl.static_range(EARLY):
        acc += tiles[t].to(tl.float32) * xs[t]
    for k0 in range(EARLY * BLOCK_K, K, BLOCK_K):
        k_ok = (k0 + kk) < K
        w = tl.load(w_rows + (k0 + kk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        # Inline without the options: the machine code of before them (sm_90: 56 registers; 48 through `_x_tile`).
        if EARLY == 0 and not X_BCAST:
            acc += w * tl.load(x_ptr + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        else:
            acc += w * _x_tile(x_ptr, k0 + kk, k_ok, BLOCK_N, X_BCAST)
    tl.store(out_ptr + n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, x_stride, N, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    dt = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + r * x_stride + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + r * x_stride + N + c, mask=m, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # SiLU in the model dtype, then the product, rounded
    tl.store(out_ptr + r * N + c, (a * u).to(dt), mask=m)


def _check(t: torch.Tensor) -> None:
    if not (t.is_cuda or INTERPRETED):
        raise RuntimeError("trace_hf.kernels.decode_ops needs CUDA tensors, or TRITON_INTERPRET=1 (CPU tests).")


def add_rmsnorm(
    res: torch.Tensor,
    add: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    round_normalized: bool = True,
    gated: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``res += add.sum(1)`` in place (``add`` [M, n, H], any float dtype; None: no add), then RMSNorm(res) * weight
    in ``res.dtype`` (Qwen3's RMSNorm: fp32 statistics, normalized value rounded to the dtype before the weight;
    ``round_normalized=False``: Qwen3.5's, the fp32 normalized value times an fp32 ``weight``, rounded once).
    ``gated``: ``(y [M, H], gate [M])``, a shared expert's output and its gate logit, also added, as
    ``sigmoid(gate) * y`` (Qwen3.5's shared expert, folded into the sum)."""
    _check(res)
    out = torch.empty_like(res) if out is None else out
    _launch_add_rmsnorm(res, add, weight, eps, out, None, None, None, None, round_normalized, gated)
    return out


def add_rmsnorm_fp4(
    res: torch.Tensor,
    add: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    hints: FP4Hints | None = None,
    round_normalized: bool = True,
    gated: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, FP4Tensor]:
    """`add_rmsnorm`, and its output quantized as ``fp4.quantize(out, "nvfp4", "row")`` in the same launch: the
    MoE input of the decode step, one launch per layer instead of two. Returns ``(out, FP4Tensor)``.

    ``hints``: `FP4Hints` buffers (NVFP4, [M, H / 8], [M, H / 16], [M, 1]) that receive the result's hints in place
    (a decode step's static buffers); the returned tensor's scales are those buffers.
    """
    _check(res)
    M, H = res.shape
    if H % 16:
        raise ValueError(
            f"add_rmsnorm_fp4 quantizes rows in NVFP4 blocks of 16: hidden size {H} is not a multiple of 16."
        )
    dev = res.device
    if hints is None:
        bits = None
        scale = torch.empty(M, H // 16, dtype=torch.uint8, device=dev)
        g = torch.empty(M, 1, dtype=torch.float32, device=dev)
    else:
        bits, scale, g = hints.mantissa_bits, hints.block_scale, hints.global_scale
        want = {"mantissa_bits": (bits, (M, H // 8), torch.uint8), "block_scale": (scale, (M, H // 16), torch.uint8),
                "global_scale": (g, (M, 1), torch.float32)}  # fmt: skip
        for name, (t, shape, dtype) in want.items():
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != dev:
                raise ValueError(f"hints.{name} must be a contiguous {dtype} tensor of shape {list(shape)} on {dev}, "
                                 f"got {t.dtype} {list(t.shape)} on {t.device}: the buffers are written in place.")  # fmt: skip
    out = torch.empty_like(res)
    packed = torch.empty(M, H // 2, dtype=torch.uint8, device=dev)
    _launch_add_rmsnorm(res, add, weight, eps, out, packed, scale, g, bits, round_normalized, gated)
    return out, FP4Tensor(packed, scale, g, "nvfp4")


#: `add_rmsnorm` warps per program (one row each) for hidden sizes up to 4096, twice that above: plain, and with the
#: NVFP4 quantization of its output (`add_rmsnorm_fp4`), whose extra row reduction and layout changes before its
#: stores add barriers (11 at 4 warps, 7 at 8; sm_90 code). 8 for the quantizing one: batch 1 decode +0.4% (two
#: rounds), 256 and 512 unchanged; 2 warps lost 1.4% at batch 1, 2 for both norms 1.3% (docs/lab-notes.md 10).
NORM_WARPS = {"plain": 4, "fp4": 8}


def _launch_add_rmsnorm(res, add, weight, eps, out, packed, scale, g, bits, round_normalized=True, gated=None) -> None:
    M, H = res.shape
    quant = packed is not None
    dummy = res  # never touched: its constexpr switch is off
    y, gate = gated if gated is not None else (dummy, dummy)
    if gated is not None and (add is None or y.shape != (M, H) or not y.is_contiguous() or gate.shape != (M,)):
        raise ValueError(f"add_rmsnorm: gated must be (y [M, H] contiguous, gate [M]) with [M, H] = {[M, H]}, beside "
                         f"an add; got {list(y.shape)} and {list(gate.shape)}, add {add is not None}.")  # fmt: skip
    _add_rmsnorm_kernel[(M,)](
        res, add.contiguous() if add is not None else res, weight, out, packed if quant else dummy,
        scale if quant else dummy, g if quant else dummy, bits if bits is not None else dummy, y, gate,
        gate.stride(0) if gated is not None else 0, H, eps, NADD=0 if add is None else add.shape[1], QUANT=quant,
        WRITE_BITS=bits is not None, NBT=triton.next_power_of_2(triton.cdiv(H, 16)), ROUND_NORMED=round_normalized,
        GATED=gated is not None, num_warps=NORM_WARPS["fp4" if quant else "plain"] * (1 if H <= 4096 else 2),
        enable_fp_fusion=False, **launch_options(res.device),
    )  # fmt: skip


#: `gemv` launch: weight rows per program, K tile, warps, pipeline stages. The best of `benchmarks/kernels/gemv_tune.py` on
#: the H200 with the weights read from HBM (docs/lab-notes.md 2h): a layer's QKV, o_proj and router products in 15.0 us
#: (2.56 TB/s) against cuBLAS's 22.8.
#: ``early_tiles`` (default 0): each program loads up to that many of its first K tiles of weights before its PDL
#: wait (`_gemv_kernel` ``EARLY``), so that under PDL a layer's weight stream overlaps the end of the kernel before
#: (the add + RMSNorm or the attention's combine) and all of them are in flight at once; the x tiles' loads follow
#: the wait together; the same FMAs in the same order (the same bits). Qwen3-30B-A3B: QKV and router have 2 tiles
#: of 1024, o_proj 4. ``x_bcast`` (default False): x read in the weights' layout (`_x_tile`), with no shared-memory
#: round trip and two barriers fewer per K tile, each x value loaded and widened once per weight row a thread holds.
#: sm_90 code with Triton 3.6 (`sass_counts.gemv_early_counts`), no spills, registers (programs of 8 warps per SM):
#: as committed 56 (4); early 2: 48 (5), its 4 16-byte weight loads ahead of the wait; early 4: 64 (4), 8 loads;
#: with x_bcast 50 (4) and 64 (4), after the wait 4 barriers instead of 10 and 14. On the H200 (docs/lab-notes.md 13): 8
#: layers' norms and one-row products under PDL 18.3 us a layer as before, 16.9 with early 2, 16.8 with 4, 19.8 with
#: x_bcast alone, 16.4 with early 2 and x_bcast (4 + x_bcast 17.7), the same bits; the decode step at batch 1 with early
#: 2 and x_bcast: BF16 +1.8-2.0%, FP4 +3.2-3.4% (two rounds).
GEMV = {"block_n": 4, "block_k": 1024, "num_warps": 8, "num_stages": 4, "early_tiles": 2, "x_bcast": True}


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` for one row (decode at batch 1): x [1, K], w [N, K] -> [1, N] in ``x.dtype``, fp32
    accumulation. Why: cuBLAS runs such products on few thread blocks (5 us for the 0.5 MB router of Qwen3-30B-A3B on
    an H200, 0.36 ms per step for the 48 o_proj); here every few weight rows (``GEMV["block_n"]``) are a program,
    so the whole GPU streams the matrix."""
    _check(x)
    if x.ndim != 2 or x.shape[0] != 1 or w.ndim != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"gemv takes x [1, K] and w [N, K] (as F.linear), got {list(x.shape)} and {list(w.shape)}.")
    N, K = w.shape
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, GEMV["block_n"]),)](
        x.contiguous(), w.contiguous(), out, N, K, BLOCK_N=GEMV["block_n"], BLOCK_K=GEMV["block_k"],
        EARLY=min(GEMV["early_tiles"], triton.cdiv(K, GEMV["block_k"])), X_BCAST=GEMV["x_bcast"],
        num_warps=GEMV["num_warps"], num_stages=GEMV["num_stages"], enable_fp_fusion=True, **launch_options(x.device),
    )  # fmt: skip
    return out


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The decode step's projections: `gemv` for one row, else ``F.linear`` (cuBLAS)."""
    if x.shape[0] == 1 and (x.is_cuda or INTERPRETED):
        return gemv(x, w)
    return torch.nn.functional.linear(x, w)


def silu_mul(x: torch.Tensor, width: int) -> torch.Tensor:
    """``silu(x[:, :width]) * x[:, width:2 width]`` in ``x.dtype`` (a dense MLP's gate and up halves, rounded as
    ``F.silu(gate) * up`` rounds), one launch; columns past ``2 width`` are not read."""
    _check(x)
    M = x.shape[0]
    if x.ndim != 2 or x.shape[1] < 2 * width or x.stride(1) != 1:
        raise ValueError(f"silu_mul takes x [M, >= 2 x {width}] with unit column stride, got {list(x.shape)}.")
    out = torch.empty(M, width, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(width))
    _silu_mul_kernel[(M, triton.cdiv(width, block))](
        x, out, x.stride(0), width, BLOCK=block, num_warps=4, enable_fp_fusion=True
    )
    return out


def router_topk(logits: torch.Tensor, top_k: int, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (fp32) over the experts, top-k, optionally renormalized: (ids int32 [M, k], weights fp32 [M, k])."""
    _check(logits)
    M, E = logits.shape
    ids = torch.empty(M, top_k, dtype=torch.int32, device=logits.device)
    w = torch.empty(M, top_k, dtype=torch.float32, device=logits.device)
    _router_topk_kernel[(M,)](
        logits.contiguous(), ids, w, E, K=top_k, E_PAD=triton.next_power_of_2(E),
        K_PAD=triton.next_power_of_2(max(top_k, 2)), NORM=normalize, num_warps=1 if E <= 256 else 4,
        enable_fp_fusion=True, **launch_options(logits.device),
    )  # fmt: skip
    return ids, w


@triton.jit
def _copy_rows(src_ptr, dst_ptr, src, dst, ok, W: tl.constexpr, W_PAD: tl.constexpr):
    cols = tl.arange(0, W_PAD)[None, :]
    m = ok[:, None] & (cols < W)
    v = tl.load(src_ptr + src[:, None] * W + cols, mask=m)
    tl.store(dst_ptr + dst[:, None] * W + cols, v, mask=m)


@triton.jit
def _load_kv_kernel(kc_ptr, ks_ptr, kg_ptr, vc_ptr, vs_ptr, vg_ptr, dkc_ptr, dks_ptr, dkg_ptr, dvc_ptr, dvs_ptr,
                    dvg_ptr, len_ptr, rows_ptr, H, P, T, WC: tl.constexpr, WS: tl.constexpr, WC_PAD: tl.constexpr,
                    WS_PAD: tl.constexpr, BLOCK_T: tl.constexpr, GATHER: tl.constexpr = False):  # fmt: skip
    """Tokens ``j`` < P of one (row, head) of the six FP4 K/V fields: dst[b, h, j] = src[r_b, h, min(j + P - len_b,
    P - 1)] (left padding removed, as `EngineRollout._load_cache`'s gathers), r_b = rows[b] with ``GATHER`` (rows
    that share a prompt read its one prefilled row), else b; sources [B_src, H, P, W], destinations [B_max, H, T,
    W], contiguous."""
    bh = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = j < P
    b = bh // H
    s = tl.minimum(j + P - tl.load(len_ptr + b), P - 1)
    if GATHER:
        sbh = tl.load(rows_ptr + b).to(tl.int64) * H + bh % H
    else:
        sbh = bh.to(tl.int64)
    src = sbh * P + s
    dst = bh.to(tl.int64) * T + j
    _copy_rows(kc_ptr, dkc_ptr, src, dst, ok, WC, WC_PAD)
    _copy_rows(vc_ptr, dvc_ptr, src, dst, ok, WC, WC_PAD)
    _copy_rows(ks_ptr, dks_ptr, src, dst, ok, WS, WS_PAD)
    _copy_rows(vs_ptr, dvs_ptr, src, dst, ok, WS, WS_PAD)
    _copy_rows(kg_ptr, dkg_ptr, src, dst, ok, 1, 1)
    _copy_rows(vg_ptr, dvg_ptr, src, dst, ok, 1, 1)


def load_fp4_kv(dst: tuple, keys: FP4Tensor, values: FP4Tensor, lengths: torch.Tensor,
                src_rows: torch.Tensor | None = None) -> None:  # fmt: skip
    """Copy a prefill's FP4 K and V ([B_src, H, P, ...] codes, block scales, row scales [B_src, H, P, 1]) into a decode
    cache's fields ``dst`` = (k, k_scale, k_g, v, v_scale, v_g) ([B_max, H, T, ...], row scales [B_max, H, T]) at
    slots 0 .. P - 1 of rows 0 .. B - 1 (B = ``lengths.shape[0]``), each row's left padding (P - ``lengths[b]``
    tokens) removed: one launch for the six copies. ``src_rows`` [B] (integer): the prefill row each decode row
    copies (rows with the same prompt share one prefilled row); None: row b copies row b (B_src = B)."""
    _, H, P, wc = keys.packed.shape
    B = lengths.shape[0]
    ws = keys.block_scale.shape[-1]
    T = dst[0].shape[2]
    if any(not t.is_contiguous() for t in dst):
        raise ValueError("load_fp4_kv: the decode cache's fields must be contiguous.")
    if src_rows is None and keys.packed.shape[0] != B:
        raise ValueError(f"load_fp4_kv: {keys.packed.shape[0]} prefill rows for {B} lengths; pass src_rows.")
    if src_rows is not None and src_rows.shape != (B,):
        raise ValueError(
            f"load_fp4_kv: src_rows must be [{B}] (one prefill row per length), got {list(src_rows.shape)}."
        )
    src = [f.contiguous() for q in (keys, values) for f in (q.packed, q.block_scale, q.global_scale)]
    lengths = lengths.contiguous()
    block_t = 64
    _load_kv_kernel[(B * H, triton.cdiv(P, block_t))](
        *src[0:3], *src[3:6], *dst, lengths, lengths if src_rows is None else src_rows.contiguous(), H, P, T, WC=wc,
        WS=ws, WC_PAD=triton.next_power_of_2(wc), WS_PAD=triton.next_power_of_2(ws), BLOCK_T=block_t,
        GATHER=src_rows is not None, num_warps=4, enable_fp_fusion=True,
    )  # fmt: skip
