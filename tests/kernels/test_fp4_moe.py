# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Triton routed experts (`trace_hf.kernels.fp4_moe`) against `TraceFP4Experts`' eval path.

The kernels match numerically, not bit for bit: their dot products sum in another order than torch's matmul.
In fp32 (the interpreter) the outputs agree to ~1e-7 relative; the bound used is 1e-5 (a hidden element that
lands on an FP4 rounding boundary could flip to its neighbour code, which these seeded inputs do not hit).
On the GPU the operands are bf16 (exact for FP4 values), so the FP4 path keeps the same kind of agreement.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trace_hf import fp4
from trace_hf.quant.experts import TraceFP4Experts
from trace_hf.quant.sites import HintSite


moe = pytest.importorskip("trace_hf.kernels.fp4_moe")
moe_common = pytest.importorskip("trace_hf.kernels.fp4_moe_common")
moe_grouped = pytest.importorskip("trace_hf.kernels.fp4_moe_grouped")
moe_triton = pytest.importorskip("trace_hf.kernels.fp4_moe_triton")
common = pytest.importorskip("trace_hf.kernels.common")
configs = pytest.importorskip("trace_hf.kernels.fp4_moe_configs")
moe_align = pytest.importorskip("trace_hf.kernels.moe_align")


def _experts(E, H, NI, seed=0, device="cpu", kernel="torch"):
    """Experts in eval mode; ``kernel="torch"`` makes them the reference path also on CUDA."""
    g = torch.Generator().manual_seed(seed)
    gu = nn.Parameter((torch.randn(E, 2 * NI, H, generator=g) * 0.1).to(device))
    d = nn.Parameter((torch.randn(E, H, NI, generator=g) * 0.1).to(device))
    return TraceFP4Experts(gu, d, nn.functional.silu, "nvfp4", "fp4", kernel=kernel).eval()


def _routing(M, E, K, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w, ids = torch.softmax(torch.randn(M, E, generator=g), -1).topk(K)
    return ids.to(device), (w / w.sum(-1, keepdim=True)).to(device)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("backend", ["torch", "triton", "chunks"])
@pytest.mark.parametrize("M,E,K", [(3, 8, 2), (37, 4, 3)])
def test_align_layout(backend, M, E, K):
    ids, _ = _routing(M, E, K)
    bm = 16
    sorted_ids, expert_ids = moe_align.moe_align(ids, E, bm, backend=backend)
    n = M * K
    flat = ids.reshape(-1)
    seen = []
    for b, e in enumerate(expert_ids.tolist()):
        rows = sorted_ids[b * bm : (b + 1) * bm]
        if e < 0:
            assert (rows == n).all(), "rows past the last segment must hold the sentinel"
            continue
        real = rows[rows < n]
        assert (flat[real.long()] == e).all(), "a block holds slots of another expert"
        seen += real.tolist()
        assert (rows[len(real) :] == n).all(), "padding is not at the end of the block"
    assert sorted(seen) == list(range(n)), "every slot must appear exactly once"
    # Experts in increasing order and slots in increasing order within an expert (stable).
    assert seen == sorted(seen, key=lambda s: (flat[s].item(), s))


@pytest.mark.parametrize("bm", [8, 16])
def test_align_one_token_launches_nothing_and_keeps_the_layout(bm):
    """One token: slot k in row block k (its experts are distinct), the layout the sorting backends give up to the
    order of the blocks, with the caller's ids as the blocks' experts; made once per shape and reused."""
    E, K = 16, 4
    ids, _ = _routing(1, E, K, seed=9)
    sorted_ids, expert_ids = moe_align.moe_align(ids, E, bm)
    s_ref, e_ref = moe_align.moe_align(ids, E, bm, backend="torch")
    assert sorted_ids.shape == s_ref.shape and expert_ids.shape == e_ref.shape
    assert torch.equal(expert_ids, ids.reshape(-1).to(torch.int32))
    blocks = sorted_ids.view(K, bm)
    assert torch.equal(blocks[:, 0], torch.arange(K, dtype=torch.int32)) and (blocks[:, 1:] == K).all()
    assert sorted(expert_ids.tolist()) == e_ref.tolist()  # the same blocks, which the sort orders by expert
    assert moe_align.moe_align(ids, E, bm)[0] is sorted_ids  # kept, no new tensor (no launch in a captured step)
    # Every slot is computed on its own, so the order of the blocks changes no bit of the output.
    mod = _experts(E, 64, 32)
    xq = fp4.quantize(torch.randn(1, 64), "nvfp4", "row", backend="torch")
    tw = torch.rand(1, K)
    y = moe.experts_from_quantized(xq, ids, tw, *mod.packed_weights())
    y_sorted = moe.experts_from_quantized(xq, ids, tw, *mod.packed_weights(), align_backend="torch")
    assert torch.equal(y, y_sorted)


def test_align_backends_agree():
    ids, _ = _routing(29, 8, 2, seed=5)
    s1, e1 = moe_align.moe_align(ids, 8, 16, backend="torch")
    s2, e2 = moe_align.moe_align(ids, 8, 16, backend="triton")
    assert torch.equal(e1, e2)
    valid = (e1 >= 0).repeat_interleave(16)
    assert torch.equal(s1[valid], s2[valid])


@pytest.mark.parametrize("M,E,K,bm", [(37, 4, 3, 16), (200, 60, 8, 128), (513, 16, 4, 64), (300, 8, 2, 16)])
def test_align_chunks_gives_the_torch_backends_bits(M, E, K, bm, monkeypatch):
    """`moe_align`'s chunked kernels (counts, scan, placement by rank in the chunk) against the stable sort: the
    same ``sorted_ids`` and ``expert_ids``, padding and blocks past the last segment included, over several chunks
    (of 64 slots, ranked 16 at a time, scanned 4 chunks at a time), experts not a power of two, and skewed ids (every
    slot on one expert)."""
    monkeypatch.setitem(moe_align.ALIGN, "chunk", 64)
    monkeypatch.setitem(moe_align.ALIGN, "sub", 16)
    monkeypatch.setitem(moe_align.ALIGN, "scan_rows", 4)
    ids, _ = _routing(M, E, K, seed=M)
    if M == 300:
        ids = torch.full_like(ids, 3)
    want = moe_align.moe_align(ids, E, bm, backend="torch")
    got = moe_align.moe_align(ids, E, bm, backend="chunks")
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.gpu
@pytest.mark.parametrize("bm", [16, 128])
def test_align_chunks_gives_the_torch_backends_bits_gpu(bm, monkeypatch):
    """At a 16K-token prefill's size (131,072 slots over Qwen3's 128 experts, skewed routing) and the default
    chunking, and through ``"auto"`` with ``ALIGN["chunked"]`` on: the torch backend's bits."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16384, 128, generator=g) + torch.linspace(0, 3, 128)  # later experts hit more often
    ids = logits.topk(8).indices.cuda()
    want = moe_align.moe_align(ids, 128, bm, backend="torch")
    monkeypatch.setitem(moe_align.ALIGN, "chunked", True)
    for backend in ("chunks", "auto"):
        got = moe_align.moe_align(ids, 128, bm, backend=backend)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), backend


#: Operand layouts of the GEMM kernels: name -> (halves, ptx, split_k of gate/up, block_m). The interpreter runs no
#: PTX, so the ``ptx`` layouts run only in the GPU tests.
LAYOUTS = {
    "interleaved": (False, False, 1, 16),
    "halves": (True, False, 1, 16),
    "halves-split-k": (True, False, 2, 16),
    "halves-ptx": (True, True, 1, 16),
    "halves-ptx-split-k": (True, True, 4, 16),
    "halves-ptx-block-m-128": (True, True, 1, 128),  # the prefill config
}


def _use_layout(monkeypatch, name):
    """The Triton kernels in one layout, for every size: also off the Gluon kernels, which would otherwise take
    decode sizes on an sm_90+ GPU."""
    halves, ptx, split_k, block_m = LAYOUTS[name]
    cfg = dict(configs.CONFIG["by_slots"][0][1], halves=halves, ptx=ptx, split_k=split_k, block_k=64, block_m=block_m)
    monkeypatch.setitem(configs.CONFIG, "by_slots", [(1 << 62, cfg)])
    monkeypatch.setitem(configs.CONFIG, "dense", cfg)
    monkeypatch.setattr(configs, "HOPPER", [])
    monkeypatch.setattr(configs, "GROUPED", {})


@pytest.fixture(params=["interleaved", "halves", "halves-split-k"])
def operand_layout(request, monkeypatch):
    """Run a test under each operand layout of the GEMM kernels (`fp4_moe_configs.CONFIG`) that the interpreter runs."""
    _use_layout(monkeypatch, request.param)
    return request.param


def test_gpus_without_hardware_fp8_get_integer_decoding(monkeypatch):
    """The halves and PTX decodings convert E4M3 in hardware (sm_89+); an A100 must get the interleaved tiles."""
    seen = {}

    def fake_capability(device=None):
        return seen["cap"]

    monkeypatch.setattr(common, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", fake_capability)
    for cap, expected in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)):
        seen["cap"] = cap
        assert common.hardware_fp8(torch.device("cuda")) is expected
    assert common.hardware_fp8(torch.device("cpu"))


def test_without_hardware_fp8_the_experts_run_interleaved_tiles(monkeypatch):
    launched = []
    gate_up = moe_triton._gate_up_kernel

    class Spy:  # records the operand layout of each gate/up launch
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((kwargs["HALVES"], kwargs["PTX"]))
                return gate_up[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(moe_triton, "_gate_up_kernel", Spy())
    monkeypatch.setattr(moe, "hardware_fp8", lambda device: False)
    mod = _experts(4, 64, 32, seed=14)
    ids, w = _routing(5, 4, 2, seed=15)
    x = torch.randn(5, 64)
    out = moe.fp4_moe_experts(x, ids, w, *mod.packed_weights())
    assert launched == [(False, False)]
    assert _rel(out, mod(x, ids, w)) < 1e-5


@pytest.mark.parametrize("M,E,H,NI,K", [(3, 8, 64, 32, 2), (40, 4, 128, 64, 2)])
def test_fp4_experts_match_module_eval_path(M, E, H, NI, K, operand_layout):
    mod = _experts(E, H, NI)
    ids, w = _routing(M, E, K)
    x = torch.randn(M, H, generator=torch.Generator().manual_seed(2))
    ref = mod(x, ids, w)  # eval path: packed weights, W4A4, fp32
    gu, d = mod.packed_weights()
    out = moe.fp4_moe_experts(x, ids, w, gu, d)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-5
    # The torch fallback computes the same function.
    assert _rel(moe.moe_experts_reference(x, ids, w, gu, d), ref) < 1e-5


@pytest.mark.parametrize("layout", ["interleaved", "halves"])
def test_padding_rows_of_the_hidden_are_never_read(layout, monkeypatch):
    """The hidden activation's quantization skips `moe_align`'s padding rows (`fp4_quant.quantize` with
    ``row_ids``), so they hold whatever was allocated. Poisoned with NaN codes, scales and row scales, they must
    leave every token's output as it was."""
    _use_layout(monkeypatch, layout)
    quantize, poisoned = moe.fp4_quant.quantize, []

    def poisoning_quantize(x, *args, row_ids=None, pad_id=0, **kwargs):
        out = quantize(x, *args, row_ids=row_ids, pad_id=pad_id, **kwargs)
        if row_ids is not None:
            q, pad = out[0] if isinstance(out, tuple) else out, row_ids >= pad_id
            q.packed[pad], q.block_scale[pad], q.global_scale[pad] = 0x77, 0x7F, float("nan")  # 0x7F: E4M3 NaN
            poisoned.append(int(pad.sum()))
        return out

    monkeypatch.setattr(moe.fp4_quant, "quantize", poisoning_quantize)
    mod = _experts(8, 64, 32, seed=16)
    ids, w = _routing(13, 8, 2, seed=17)
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(18))
    out = moe.fp4_moe_experts(x, ids, w, *mod.packed_weights())
    assert poisoned and poisoned[0] > 0  # the hidden was quantized with padding rows skipped, and there were some
    assert torch.isfinite(out).all() and _rel(out, mod(x, ids, w)) < 1e-5


@pytest.mark.parametrize("block_m", [32, 64])
def test_larger_expert_blocks_compute_the_same(block_m, monkeypatch):
    """A launch config's ``block_m`` (prefill: fewer re-reads of each expert's weights) changes the padded layout, not
    the result; the hidden activation's hints follow the layout."""
    cfg = dict(configs.CONFIG["by_slots"][-1][1], halves=True, ptx=False, block_k=64, block_m=block_m)
    monkeypatch.setitem(configs.CONFIG, "by_slots", [(1 << 62, cfg)])
    mod = _experts(4, 64, 32, seed=8)
    ids, w = _routing(37, 4, 2, seed=9)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(10))
    xq = fp4.quantize(x, "nvfp4", "row")
    y, hidden = moe.experts_from_quantized(xq, ids, w, *mod.packed_weights(), return_hidden=True)
    assert hidden.slots.numel() % block_m == 0
    assert _rel(y.sum(1), mod(x, ids, w)) < 1e-5
    monkeypatch.setitem(configs.CONFIG, "by_slots", [(1 << 62, dict(cfg, block_m=16))])
    _, h16 = moe.experts_from_quantized(xq, ids, w, *mod.packed_weights(), return_hidden=True)
    pos, pos16 = hidden.positions(), h16.positions()
    assert torch.equal(hidden.hints.mantissa_bits[pos], h16.hints.mantissa_bits[pos16])


def test_module_kernel_path_matches_torch_path_and_records_the_same_input():
    class Stub:  # stands in for HintRecorder, which the module calls back
        def record_input(self, site, q, hints=None):
            self.q, self.hints = q, hints

        def record_routing(self, site, ids):
            self.ids = ids

    ids, w = _routing(9, 4, 2, seed=6)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(7))
    got = {}
    for kernel in ("torch", "triton"):
        mod = _experts(4, 64, 32, seed=5, kernel=kernel)
        stub = Stub()
        mod.sites = {s: HintSite(s, 0, recorder=stub) for s in ("routing", "experts_input")}
        got[kernel] = (mod(x, ids, w), stub)
    assert _rel(got["triton"][0], got["torch"][0]) < 1e-5
    q_kernel, q_torch = got["triton"][1].q, got["torch"][1].q
    # The input quantization is the same function on both paths, so the hints are too.
    assert torch.equal(q_kernel.packed, q_torch.packed) and torch.equal(q_kernel.block_scale, q_torch.block_scale)
    assert torch.equal(got["triton"][1].ids, ids)
    # The hints handed to the recorder with the codes are those of the codes (`fp4.quantize_with_hints`).
    for _, stub in got.values():
        want = fp4.extract_hints(stub.q)
        fields = ("mantissa_bits", "block_scale", "global_scale")
        assert all(torch.equal(getattr(stub.hints, f), getattr(want, f)) for f in fields)


def test_fp4_experts_return_the_input_hints():
    mod = _experts(4, 64, 32)
    ids, w = _routing(5, 4, 2)
    x = torch.randn(5, 64)
    out, hints = moe.fp4_moe_experts(x, ids, w, *mod.packed_weights(), return_hints=True)
    ref = fp4.extract_hints(fp4.quantize(x, "nvfp4", "row"))
    assert torch.equal(hints.mantissa_bits, ref.mantissa_bits)
    assert torch.equal(hints.block_scale, ref.block_scale)
    assert torch.equal(hints.global_scale, ref.global_scale)


def test_w4a16_and_dense_paths(operand_layout):
    mod = _experts(4, 64, 32, seed=3)
    ids, w = _routing(6, 4, 2, seed=4)
    x = torch.randn(6, 64)
    gu, d = mod.packed_weights()
    out = moe.fp4_moe_experts(x, ids, w, gu, d, activations="none")
    assert _rel(out, moe.moe_experts_reference(x, ids, w, gu, d, activations="none")) < 1e-5
    dense = moe.fp4_moe_experts(x, ids, w, mod.gate_up_proj.detach(), mod.down_proj.detach(), activations="none")
    ref = moe.moe_experts_reference(x, ids, w, mod.gate_up_proj.detach(), mod.down_proj.detach(), activations="none")
    assert _rel(dense, ref) < 1e-5


@pytest.mark.parametrize("return_hidden", [False, True])
@pytest.mark.parametrize("launch", [None, {"rows": 4, "values_per_thread": 16}, {"rows": 2, "values_per_thread": 2}])
def test_split_k_epilogue_quantizes_as_quantize(return_hidden, launch, monkeypatch):
    """Batch 1's split-K path sums the partials, applies SiLU * up and quantizes the hidden in one launch: the codes,
    scales and hints are those of `quantize` (and the torch reference) of the hidden the unfused path writes, with
    a NaN partial, an all-zero row, saturating and tiny values, padding rows and an unused row block; for the
    default launch (`HIDDEN_LAUNCH`) and others, a block of 16 values spread over threads."""
    from trace_hf.kernels import fp4_quant

    if launch:
        monkeypatch.setattr(moe_common, "HIDDEN_LAUNCH", launch)

    g = torch.Generator().manual_seed(21)
    split, bm, NI, top_k = 4, 8, 96, 2  # 96: a width that is not a power of two (the program pads to 128)
    ids, _ = _routing(5, 4, top_k, seed=22)
    sorted_ids, expert_ids = moe_align.moe_align(ids, 4, bm, backend="torch")
    expert_ids[-1] = -1  # a row block no expert uses: skipped by both paths
    P = sorted_ids.numel()
    part = torch.randn(split, P, 2 * NI, generator=g) * torch.logspace(-6, 3, 2 * NI)
    part[:, 0, :NI] = 0.0  # gate 0: an all-zero hidden row
    part[2, 1, 5] = float("nan")  # poisons row 1: NaN row scale
    padding = sorted_ids == 10
    part[:, padding] = float("nan")  # the gate/up kernels leave padding rows unwritten: garbage must not leak
    xg = torch.rand(5, generator=g) + 0.5
    wg = torch.rand(4, generator=g) + 0.5
    args = (part, xg, wg, sorted_ids, expert_ids, 10, top_k, bm, True, True)
    h, _ = moe_common.down_input(*args, False, False)
    hq, hidden = moe_common.down_input(*args, True, return_hidden)
    used = (expert_ids >= 0).repeat_interleave(bm)
    want, want_hints = fp4_quant.quantize(h[used], "nvfp4", "row", return_hints=True)
    ref = fp4.quantize(h[used], "nvfp4", "row", backend="torch")
    for got_t, want_t, ref_t in (
        (hq.packed, want.packed, ref.packed),
        (hq.block_scale, want.block_scale, ref.block_scale),
    ):
        assert torch.equal(got_t[used], want_t) and torch.equal(want_t, ref_t)
    torch.testing.assert_close(hq.global_scale[used], ref.global_scale, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(hq.global_scale[1]).all() and (hq.global_scale[0] == 0).all()
    assert (hq.packed[used & padding] == 0).all() and (hq.global_scale[used & padding] == 0).all()
    if return_hidden:
        assert torch.equal(hidden.hints.mantissa_bits[used], want_hints.mantissa_bits)
        assert hidden.hints.block_scale is hq.block_scale and torch.equal(hidden.slots, sorted_ids)
    else:
        assert hidden is None


@pytest.mark.gpu
def test_ptx_decoding_is_exact_for_every_code_and_scale_byte():
    """`fp4_halves_f16` against the spec: all 256 code bytes (two nibbles) times all 256 E4M3 scale bytes, bit
    for bit, including -0, subnormal scales and the NaN scale 0x7F / 0xFF."""
    import triton
    import triton.language as tl

    @triton.jit
    def decode(p_ptr, s_ptr, lo_ptr, hi_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        lo, hi = common.fp4_halves_f16(tl.load(p_ptr + offs), tl.load(s_ptr + offs))
        tl.store(lo_ptr + offs, lo)
        tl.store(hi_ptr + offs, hi)

    grid = torch.arange(256 * 256, device="cuda")
    p, sb = (grid % 256).to(torch.uint8), (grid // 256).to(torch.uint8)
    lo, hi = torch.empty(grid.numel(), dtype=torch.float16, device="cuda"), torch.empty_like(grid, dtype=torch.float16)
    decode[(grid.numel() // 1024,)](p, sb, lo, hi, BLOCK=1024)
    s = fp4.e4m3_decode(sb) * 2.0**-14
    for got, nibble in ((lo, p & 15), (hi, p >> 4)):
        want = (fp4.e2m1_decode(nibble) * s).half()
        assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(want).sum() == 2 * 256
        ok = ~torch.isnan(want)
        assert torch.equal(got[ok].view(torch.int16), want[ok].view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp4_experts_gpu_operand_layouts(layout, monkeypatch):
    """Each operand layout: the module's kernel path against its torch eval path, with a NaN row and
    expert-parallel sentinels (which the module maps before calling the kernels)."""
    _use_layout(monkeypatch, layout)
    E, H, NI, K, M = 16, 256, 128, 4, 40
    ids, w = _routing(M, E, K, seed=13, device="cuda")
    x = torch.randn(M, H, device="cuda")
    x[7, 3] = float("nan")
    ids[:, -1] = torch.where(torch.arange(M, device="cuda") % 3 == 0, E, ids[:, -1])  # another rank's expert
    ref = _experts(E, H, NI, seed=12, device="cuda", kernel="torch")(x, ids, w)
    out = _experts(E, H, NI, seed=12, device="cuda", kernel="triton")(x, ids, w)
    assert torch.isnan(out[7]).all()
    keep = torch.arange(M, device="cuda") != 7
    assert torch.isfinite(out[keep]).all()
    assert _rel(out[keep], ref[keep]) < 1e-3  # summation order, and a rare hidden code flip


@pytest.mark.gpu
def test_fp4_experts_gpu_qwen3_shapes():
    dev = "cuda"
    E, H, NI, K = 128, 2048, 768, 8
    mod = _experts(E, H, NI, device=dev)
    for M in (1, 64, 300):
        ids, w = _routing(M, E, K, seed=M, device=dev)
        x = torch.randn(M, H, device=dev)
        ref = mod(x, ids, w)
        gu, d = mod.packed_weights()
        out = moe.fp4_moe_experts(x, ids, w, gu, d)
        # bf16 operands are exact for FP4 values: only the summation order differs (and rare hidden code flips).
        assert _rel(out, ref) < 1e-3
        xb = x.bfloat16()
        outb = moe.fp4_moe_experts(xb, ids, w, gu, d)
        assert _rel(outb, mod(xb.float(), ids, w)) < 2e-2  # bf16 output rounding
        dense = moe.fp4_moe_experts(xb, ids, w, mod.gate_up_proj.detach().bfloat16(),
                                    mod.down_proj.detach().bfloat16(), activations="none")  # fmt: skip
        refd = moe.moe_experts_reference(xb, ids, w, mod.gate_up_proj.detach().bfloat16(),
                                         mod.down_proj.detach().bfloat16(), activations="none")  # fmt: skip
        assert _rel(dense, refd) < 2e-2  # the hidden activation enters the down GEMM as bf16


@pytest.mark.gpu
def test_grouped_gemm_training_path_matches_the_expert_loop_gpu():
    """The QAT forward on CUDA (grouped_mm, no host sync) against the per-expert loop: same loss and gradients
    up to bf16 GEMM rounding."""
    from trace_hf.quant import expert_paths as ex

    mod = _experts(16, 256, 128, device="cuda").to(torch.bfloat16).train()
    ids, w = _routing(300, 16, 4, device="cuda")
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    results = []
    for grouped in (True, False):
        orig = ex.grouped_mm_ok
        ex.grouped_mm_ok = (lambda *a: True) if grouped else (lambda *a: False)
        try:
            out = mod(x, ids, w.bfloat16())
            (out.float() ** 2).sum().backward()
        finally:
            ex.grouped_mm_ok = orig
        results.append(
            (out.detach().float(), mod.gate_up_proj.grad.float().clone(), mod.down_proj.grad.float().clone())
        )
        mod.zero_grad(set_to_none=True)
    for a, b in zip(*results):
        assert _rel(a, b) < 2e-2


def test_nan_input_row_poisons_only_its_token(operand_layout):
    mod = _experts(4, 64, 32, seed=8)
    ids, w = _routing(5, 4, 2, seed=9)
    x = torch.randn(5, 64)
    x[2, 17] = float("nan")
    out = moe.fp4_moe_experts(x, ids, w, *mod.packed_weights())
    assert torch.isnan(out[2]).all()
    keep = [0, 1, 3, 4]
    assert torch.isfinite(out[keep]).all()
    assert _rel(out[keep], mod(x, ids, w)[keep]) < 1e-5


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_expert_parallel_sentinels_contribute_nothing(kernel):
    """Routing ids >= num_experts (another rank's expert) add nothing, on both eval paths."""
    mod = _experts(4, 64, 32, seed=10, kernel=kernel)
    ids, w = _routing(6, 4, 2, seed=11)
    x = torch.randn(6, 64)
    with_sentinel = ids.clone()
    with_sentinel[:, 1] = 4  # the second slot of every token belongs to another rank
    only_first = torch.stack([ids[:, 0], ids[:, 0]], 1)
    w_first = torch.stack([w[:, 0], torch.zeros_like(w[:, 0])], 1)
    assert _rel(mod(x, with_sentinel, w), mod(x, only_first, w_first)) < 1e-6


@pytest.mark.parametrize("bad", [{"stages": 1}, {"stages": 2, "x_shared": False}])
def test_hopper_entry_with_a_bad_ring_is_an_error(bad):
    """A weight ring of one stage, or one without the activations in shared memory, is refused with the fix."""
    cfg = dict(configs.HOPPER[-1][1], **bad)
    with pytest.raises(ValueError, match="stages"):
        configs.check_hopper_entry(cfg)
    configs.check_hopper_entry(dict(cfg, stages=0))  # no ring: fine


@pytest.mark.parametrize("bad", [{"x_shared": True}, {"x_shared": True, "stages": 2}, {"early_weights": 3}])
def test_hopper_entry_with_bad_early_weights_is_an_error(bad):
    """``early_weights`` (0, 1 or 2) holds the weights in registers: with staged activations or a ring, or another
    value, it is refused."""
    for setting in ({"early_weights": 1}, {"early_weights": 2}):
        cfg = dict(configs.HOPPER[0][1], **setting)
        assert configs.check_hopper_entry(cfg) == 0
        with pytest.raises(ValueError, match="early_weights"):
            configs.check_hopper_entry(dict(cfg, **bad))


# ----------------------------------------------------------------------------------------------------------
# The grouped path (`GROUPED`: many tokens per expert, prefill)
# ----------------------------------------------------------------------------------------------------------


def _grouped(monkeypatch):
    """Route every W4A4 call that asks for it (``bf16_sums=True``) through the grouped path (on the GPU: from
    `GROUPED["from"]` slots per expert, sm_90+)."""
    monkeypatch.setattr(moe, "grouped_config", lambda n, e, dev: dict(configs.GROUPED))


def test_bf16_decoding_is_exact_for_every_code_and_scale_byte():
    """The grouped GEMMs' operands, ``E2M1 * s`` in bf16, against the torch format (global scale 1): every code
    with every E4M3 byte (subnormal scales, 448, the NaN bytes) and random rows, bit for bit."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(16)  # 256 values: the 16 codes, 16 times
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(256, 1)  # [256, 128]
    scale = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 16)  # row r: every block has scale byte r
    g = torch.Generator().manual_seed(15)
    rnd = fp4.quantize(torch.randn(37, 96, generator=g) * 3, "nvfp4", "row")
    for p, sb in ((packed, scale), (rnd.packed, rnd.block_scale)):
        ref = fp4.FP4Tensor(p, sb, torch.ones(p.shape[0], 1), "nvfp4").dequantize(torch.bfloat16)
        out = moe_grouped._exact_bf16(p, sb, 16)
        nan = torch.isnan(ref)
        assert torch.equal(torch.isnan(out), nan)
        assert torch.equal(out[~nan].view(torch.int16), ref[~nan].view(torch.int16))
    assert torch.isnan(moe_grouped._exact_bf16(packed, scale, 16)[0x7F]).all()


@pytest.mark.parametrize("M,E,K", [(40, 4, 2), (37, 8, 3), (1, 4, 4)])
def test_grouped_path_computes_the_reference_with_bf16_gemm_sums(M, E, K, monkeypatch):
    """The grouped path is `moe_experts_reference` with each GEMM's sum rounded to bf16 (not the fp32 function the
    other kernels compute), and the hidden it returns is the one its down GEMM read. One token checks that the
    segments come in expert order (the "auto" alignment of one token does not sort)."""
    mod = _experts(E, 64, 32, seed=13)
    ids, w = _routing(M, E, K, seed=14)
    x = torch.randn(M, 64, generator=torch.Generator().manual_seed(15))
    gu, d = mod.packed_weights()
    _grouped(monkeypatch)
    xq = fp4.quantize(x, "nvfp4", "row")
    y, hidden = moe.experts_from_quantized(xq, ids, w, gu, d, return_hidden=True, bf16_sums=True)
    ref = moe.moe_experts_reference(x, ids, w, gu, d, gemm_dtype=torch.bfloat16)
    assert _rel(y.sum(1), ref) < 1e-6
    assert _rel(y.sum(1), moe.moe_experts_reference(x, ids, w, gu, d)) > 1e-5  # the bf16 sums are visible
    # Each slot's output from the returned hidden codes: round(h @ W_down[e].T) * row scale * g_w * routing weight.
    pos = hidden.positions()
    h, hg = moe._exact_and_global(fp4.FP4Tensor(*(f[pos] for f in (hidden.q.packed, hidden.q.block_scale,
                                                                    hidden.q.global_scale)), "nvfp4"))  # fmt: skip
    dq, dg = moe._exact_and_global(d)
    e = ids.reshape(-1).long()
    slot_out = torch.einsum("si,shi->sh", h, dq[e]).bfloat16().float() * hg * dg[e] * w.reshape(-1, 1)
    assert _rel(y.reshape(M * K, -1), slot_out) < 1e-6
    summed = moe.experts_from_quantized(xq, ids, w, gu, d, reduce=True, bf16_sums=True)
    assert summed.shape == (M, 64) and _rel(summed, y.sum(1)) < 1e-6  # the epilogue's fused sum over the slots
    fp32 = moe.experts_from_quantized(xq, ids, w, gu, d, reduce=True)  # not asked: fp32 sums, the other kernels
    assert _rel(fp32, moe.moe_experts_reference(x, ids, w, gu, d)) < 1e-5


def test_grouped_path_nan_input_row_poisons_only_its_token(monkeypatch):
    mod = _experts(4, 64, 32, seed=8)
    ids, w = _routing(9, 4, 2, seed=9)
    x = torch.randn(9, 64)
    x[2, 17] = float("nan")
    _grouped(monkeypatch)
    out = moe.experts_from_quantized(fp4.quantize(x, "nvfp4", "row"), ids, w, *mod.packed_weights(), reduce=True,
                                     bf16_sums=True)  # fmt: skip
    assert torch.isnan(out[2]).all()
    keep = torch.arange(9) != 2
    assert torch.isfinite(out[keep]).all()
    ref = moe.moe_experts_reference(x, ids, w, *mod.packed_weights(), gemm_dtype=torch.bfloat16)
    assert _rel(out[keep], ref[keep]) < 1e-6


#: Tiles of the fp32-sum grouped GEMMs that the interpreter's small shapes divide (H 64, I 32); ``group_m`` 2 over an
#: odd number of row blocks covers the last, partial group of the tile order.
FP32_TILES = {"block_m": 16, "block_n_gate_up": 16, "block_n_down": 32, "block_k": 16, "group_m": 2, "num_warps": 4,
              "num_stages": 2}  # fmt: skip


def _grouped_fp32(monkeypatch, tiles=FP32_TILES):
    """`_grouped` with ``GROUPED["fp32_sums"]`` on: calls that do not ask for bf16 sums take the grouped path too.
    Returns the list of the fp32-sum calls made (their ``M``)."""
    monkeypatch.setattr(moe, "grouped_config", lambda n, e, dev: dict(configs.GROUPED, fp32_sums=True, fp32=tiles))
    calls, inner = [], moe_grouped.experts_fp32

    def spy(cfg, xq, topk_ids, *a):
        calls.append(topk_ids.shape[0])
        return inner(cfg, xq, topk_ids, *a)

    monkeypatch.setattr(moe_grouped, "experts_fp32", spy)
    return calls


@pytest.mark.parametrize("M,E,K", [(40, 4, 2), (37, 8, 3), (1, 4, 4)])
def test_grouped_path_with_fp32_sums_computes_the_reference(M, E, K, monkeypatch):
    """With ``GROUPED["fp32_sums"]`` the grouped path computes the fp32-sum function of the other kernels (not the
    bf16-sum one, which ``bf16_sums=True`` still gets), returns their [M, K, H] layout (so ``reduce`` sums the slots
    as their callers do, bit for bit), and its hidden is the one its down GEMM read."""
    mod = _experts(E, 64, 32, seed=13)
    ids, w = _routing(M, E, K, seed=14)
    x = torch.randn(M, 64, generator=torch.Generator().manual_seed(15))
    gu, d = mod.packed_weights()
    xq = fp4.quantize(x, "nvfp4", "row")
    kernels = moe.experts_from_quantized(xq, ids, w, gu, d)  # the Triton kernels (the interpreter has no GROUPED)
    calls = _grouped_fp32(monkeypatch)
    y, hidden = moe.experts_from_quantized(xq, ids, w, gu, d, return_hidden=True)
    assert y.shape == (M, K, 64) and calls == [M]
    ref = moe.moe_experts_reference(x, ids, w, gu, d)
    assert _rel(y.sum(1), ref) < 1e-5 and _rel(y.sum(1), kernels.sum(1)) < 1e-5
    assert _rel(y.sum(1), moe.moe_experts_reference(x, ids, w, gu, d, gemm_dtype=torch.bfloat16)) > 1e-5
    pos = hidden.positions()
    h, hg = moe._exact_and_global(fp4.FP4Tensor(*(f[pos] for f in (hidden.q.packed, hidden.q.block_scale,
                                                                    hidden.q.global_scale)), "nvfp4"))  # fmt: skip
    dq, dg = moe._exact_and_global(d)
    e = ids.reshape(-1).long()
    slot_out = torch.einsum("si,shi->sh", h, dq[e]) * hg * dg[e] * w.reshape(-1, 1)
    assert _rel(y.reshape(M * K, -1), slot_out) < 1e-6
    assert torch.equal(moe.experts_from_quantized(xq, ids, w, gu, d, reduce=True), y.sum(1))
    bf16 = moe.experts_from_quantized(xq, ids, w, gu, d, reduce=True, bf16_sums=True)
    assert _rel(bf16, moe.moe_experts_reference(x, ids, w, gu, d, gemm_dtype=torch.bfloat16)) < 1e-6


def test_grouped_path_with_fp32_sums_needs_tiles_that_divide_the_shapes(monkeypatch):
    """Tiles that do not divide the expert shapes: the call takes the other kernels (the same function)."""
    mod = _experts(4, 64, 32, seed=3)
    ids, w = _routing(40, 4, 2, seed=4)
    xq = fp4.quantize(torch.randn(40, 64, generator=torch.Generator().manual_seed(5)), "nvfp4", "row")
    want = moe.experts_from_quantized(xq, ids, w, *mod.packed_weights())
    calls = _grouped_fp32(monkeypatch, dict(FP32_TILES, block_n_gate_up=64))  # I = 32
    assert not configs.check_grouped_fp32(moe.grouped_config(80, 4, None), 64, 32)
    assert torch.equal(moe.experts_from_quantized(xq, ids, w, *mod.packed_weights()), want) and not calls


def test_grouped_path_with_fp32_sums_nan_input_row_poisons_only_its_token(monkeypatch):
    mod = _experts(4, 64, 32, seed=8)
    ids, w = _routing(9, 4, 2, seed=9)
    x = torch.randn(9, 64)
    x[2, 17] = float("nan")
    calls = _grouped_fp32(monkeypatch)
    out = moe.experts_from_quantized(fp4.quantize(x, "nvfp4", "row"), ids, w, *mod.packed_weights(), reduce=True)
    assert calls == [9]
    assert torch.isnan(out[2]).all()
    keep = torch.arange(9) != 2
    assert torch.isfinite(out[keep]).all()
    assert _rel(out[keep], moe.moe_experts_reference(x, ids, w, *mod.packed_weights())[keep]) < 1e-5


def test_grouped_config_takes_many_slots_per_expert_on_hopper_only(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(configs, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    start = configs.GROUPED["from"] * 128
    assert configs.grouped_config(start, 128, cuda) == configs.GROUPED
    assert configs.grouped_config(start - 1, 128, cuda) is None
    assert configs.grouped_config(start, 128, torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert configs.grouped_config(start, 128, cuda) is None
    monkeypatch.setattr(configs, "GROUPED", {})
    assert configs.grouped_config(start, 128, cuda) is None


@pytest.mark.gpu
def test_grouped_path_gpu_qwen3_shapes():
    """A 6,144-token prefill call (384 slots per expert) at Qwen3-30B-A3B's expert shapes takes the grouped path and
    computes the reference with bf16 GEMM sums (checked on its first 512 tokens: tokens are independent); against
    the wgmma kernels (fp32 sums) it differs by the hidden codes that flip."""
    dev = torch.device("cuda")
    E, H, NI, K, M = 128, 2048, 768, 8, 6144
    assert configs.grouped_config(M * K, E, dev) is not None
    mod = _experts(E, H, NI, device=dev)
    gu, d = mod.packed_weights()
    ids, w = _routing(M, E, K, seed=16, device=dev)
    x = torch.randn(M, H, device=dev).bfloat16()
    xq = fp4.quantize(x, "nvfp4", "row")
    y, hidden = moe.experts_from_quantized(xq, ids, w, gu, d, return_hidden=True, bf16_sums=True)
    ref = torch.cat([moe.moe_experts_reference(x[i : i + 128].float(), ids[i : i + 128], w[i : i + 128], gu, d,
                                               gemm_dtype=torch.bfloat16) for i in range(0, 512, 128)])  # fmt: skip
    assert _rel(y[:512].sum(1), ref) < 1e-3  # cutlass sums in another order: a rare bf16 rounding and code flip
    assert hidden.hints.mantissa_bits.shape[0] == hidden.slots.numel()
    summed = moe.experts_from_quantized(xq, ids, w, gu, d, reduce=True, bf16_sums=True)
    assert _rel(summed, y.sum(1)) < 1e-6
    y_wgmma = moe.experts_from_quantized(xq, ids, w, gu, d)  # not asked: the wgmma kernels, fp32 sums
    assert _rel(y.sum(1), y_wgmma.sum(1)) < 5e-2


@pytest.mark.gpu
def test_grouped_path_with_fp32_sums_gpu_qwen3_shapes(monkeypatch):
    """A 6,144-token prefill call at Qwen3-30B-A3B's expert shapes with ``GROUPED["fp32_sums"]`` and the table's fp32
    tiles: the fp32-sum function (the reference on its first 512 tokens), and the wgmma kernels' outputs up to the
    order of the sums (a rare hidden code flips), far closer than the bf16-sum path."""
    dev = torch.device("cuda")
    E, H, NI, K, M = 128, 2048, 768, 8, 6144
    cfg = configs.grouped_config(M * K, E, dev)
    assert cfg is not None and configs.check_grouped_fp32(cfg, H, NI)
    mod = _experts(E, H, NI, device=dev)
    gu, d = mod.packed_weights()
    ids, w = _routing(M, E, K, seed=16, device=dev)
    x = torch.randn(M, H, device=dev).bfloat16()
    xq = fp4.quantize(x, "nvfp4", "row")
    y_wgmma = moe.experts_from_quantized(xq, ids, w, gu, d)  # fp32_sums off (the table's default): the wgmma kernels
    bf16 = moe.experts_from_quantized(xq, ids, w, gu, d, reduce=True, bf16_sums=True)
    monkeypatch.setitem(configs.GROUPED, "fp32_sums", True)
    y, hidden = moe.experts_from_quantized(xq, ids, w, gu, d, return_hidden=True)
    assert y.shape == (M, K, H) and hidden.hints.mantissa_bits.shape[0] == hidden.slots.numel()
    ref = torch.cat([moe.moe_experts_reference(x[i : i + 128].float(), ids[i : i + 128], w[i : i + 128], gu, d)
                     for i in range(0, 512, 128)])  # fmt: skip
    assert _rel(y[:512].sum(1), ref) < 1e-3
    assert torch.equal(moe.experts_from_quantized(xq, ids, w, gu, d, reduce=True), y.sum(1))
    close, far = _rel(y.sum(1), y_wgmma.sum(1)), _rel(bf16, y_wgmma.sum(1))
    assert close < 1e-3 and close < far / 4, (close, far)


@pytest.mark.parametrize("opt_in", [False, True])
def test_module_takes_the_grouped_path_only_with_prefill_bf16_gemms(opt_in, monkeypatch):
    """`TraceFP4Config.prefill_bf16_gemms` reaches the eval forward of experts the quantizer builds: with it, the
    bf16-sum function; without it (the default), the fp32 one, even where the grouped path would serve the call."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from trace_hf import TraceFP4Config

    hf = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=4))
    g = torch.Generator().manual_seed(17)
    with torch.no_grad():
        hf.gate_up_proj.copy_(torch.randn(hf.gate_up_proj.shape, generator=g) * 0.1)
        hf.down_proj.copy_(torch.randn(hf.down_proj.shape, generator=g) * 0.1)
    config = TraceFP4Config(experts_kernel="triton", prefill_bf16_gemms=opt_in)
    mod = TraceFP4Experts.from_experts(hf, config).eval()
    assert mod.prefill_bf16_gemms is opt_in
    ids, w = _routing(40, 4, 2, seed=18)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(19))
    _grouped(monkeypatch)
    ref = moe.moe_experts_reference(x, ids, w, *mod.packed_weights(), gemm_dtype=torch.bfloat16 if opt_in else None)
    assert _rel(mod(x, ids, w), ref) < 1e-5
