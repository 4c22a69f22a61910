# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The wgmma expert GEMMs (`trace_hf.kernels.fp4_moe_wgmma`, sm_90+, many tokens per expert) against the spec, the
decode kernels and the torch path, and the dispatch that picks them (`fp4_moe_configs.WGMMA`).

Gluon does not run in the interpreter, so the numerics are GPU tests (as in tests/kernels/test_fp4_moe_hopper.py): the MMA
adds exact products in fp32 in another order than torch, so each GEMM must match an fp64 reference of the same
dequantized operands to fp32 rounding, and NaN scales must reach exactly the rows that read them. On the CPU the
dispatch is checked with a patched device capability, and the kernels are compiled for sm_90 with Triton's bundled
ptxas: every table entry builds, keeps its wgmma instructions in the loop and does not spill.
"""

from __future__ import annotations

import json
import math
import os
import types

import pytest
import torch

from trace_hf import fp4


moe = pytest.importorskip("trace_hf.kernels.fp4_moe")
moe_common = pytest.importorskip("trace_hf.kernels.fp4_moe_common")
configs = pytest.importorskip("trace_hf.kernels.fp4_moe_configs")
common = pytest.importorskip("trace_hf.kernels.common")


def _hopper_gpu():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def _packed(E, N, K, seed, special=False):
    """NVFP4 expert weights; with ``special`` every code and scale class: -0 codes, the largest code everywhere in a
    row, subnormal E4M3 scales, zero scales, and a NaN scale in row 3 of every expert."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(E, N, K, device="cuda", generator=g) * 0.05
    q = fp4.quantize(w, "nvfp4", "expert")
    if special:
        codes = q.packed.view(E, N, K // 2)
        codes[:, 0, :4] = 0x88
        codes[:, 1, :] = 0x77
        sc = q.block_scale.view(E, N, K // 16)
        sc[:, 2, :] = torch.arange(1, 8, device="cuda", dtype=torch.uint8).repeat(K // 16 // 7 + 1)[: K // 16]
        sc[:, 4, ::3] = 0
        sc[:, 3, 1] = 0x7F
    return q


def _routing(M, E, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w, ids = torch.softmax(torch.randn(M, E, device="cuda", generator=g), -1).topk(K)
    return ids, w


def _input(M, H, seed):
    """Activations with a zero row and a row of ties (every value the same, the block maximum in every block)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, H, device="cuda", generator=g)
    x[1] = 0.0
    x[2] = 0.75
    return x


def _entries():
    return [cfg for _, cfg in configs.WGMMA]


def _gate_up_caps(cfg):
    """The gate/up register caps an entry may launch with (`fp4_moe_configs.gate_up_cap`): one, or its choices."""
    caps = cfg.get("maxnreg")
    return list(caps) if isinstance(caps, (tuple, list)) else [caps]


def _with_table(monkeypatch, cfg):
    monkeypatch.setattr(configs, "WGMMA", [(0, cfg)])


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm_90+ GPU")
@pytest.mark.parametrize("cfg", _entries(), ids=lambda c: f"t{c['block_t']}w{c['num_warps']}")
@pytest.mark.parametrize("M", [48, 300])
def test_wgmma_gemms_match_fp64_of_the_same_operands(M, cfg, monkeypatch):
    """Both GEMMs of every `WGMMA` entry: the hidden activation before its quantization against fp64 of the dequantized
    input and weights, and the down projection against fp64 of the hidden codes the kernels quantized; every code
    and scale class decodes to the spec's value, NaN scales poison exactly their rows, padding rows are 0."""
    from trace_hf.kernels import fp4_moe_wgmma as wg
    from trace_hf.kernels import fp4_quant
    from trace_hf.kernels.moe_align import moe_align

    E, H, NI, K = 8, 512, 256, 4
    wgu = _packed(E, 2 * NI, H, seed=1, special=True)
    wdn = _packed(E, H, NI, seed=2, special=True)
    xq = fp4_quant.quantize(_input(M, H, seed=M), "nvfp4", "row")
    ids, tw = _routing(M, E, K, seed=M + 1)
    bt = cfg["block_t"]
    sorted_ids, expert_ids = moe_align(ids, E, bt)
    P = sorted_ids.numel()
    hs = []
    # One shared-memory allocation for the staged activations or one per K-slice; gate's MMAs waited for before up's
    # decoding or not (the same MMAs on the same accumulators in the same order): the same bits.
    for slices, gate_first in ((False, False), (True, False), (False, True),
                               (cfg.get("slice_buffers", False), cfg.get("gate_first", False))):  # fmt: skip
        h = torch.full((P, NI), float("inf"), device="cuda")
        wg.gate_up_kernel[(P // bt, NI // cfg["block_n_gate_up"])](
            xq.packed, xq.block_scale, xq.global_scale.reshape(-1), wgu.packed, wgu.block_scale,
            wgu.global_scale.reshape(-1), h, sorted_ids, expert_ids, M * K, K, H, NI, BLOCK_T=bt,
            BLOCK_N=cfg["block_n_gate_up"], BLOCK_K=cfg["block_k"], NUM_WARPS=cfg["num_warps"], SLICE_BUFFERS=slices,
            GATE_FIRST=gate_first, PDL=False, num_warps=cfg["num_warps"],
        )  # fmt: skip
        hs.append(h)
    for other in hs[1:]:
        assert torch.equal(hs[0].nan_to_num(7.0), other.nan_to_num(7.0)), "a loop variant changed the result"
    h = hs[0]
    real = sorted_ids < M * K
    slots = sorted_ids[real].long()
    e = ids.reshape(-1)[slots]
    gate, up = torch.einsum("ph,pnh->pn", xq.dequantize().double()[slots // K], wgu.dequantize().double()[e]).chunk(
        2, -1
    )
    want = torch.nn.functional.silu(gate) * up
    got = h[real].double()
    assert torch.isnan(got[:, 3]).all() and torch.isnan(want[:, 3]).all()  # gate row 3 reads the NaN scale
    ok = torch.arange(NI, device="cuda") != 3
    assert not torch.isnan(got[:, ok]).any()
    err = (got[:, ok] - want[:, ok]).abs().max() / want[:, ok].abs().max()
    assert err < 1e-5, f"gate/up {cfg}: {err}"
    in_segment = (expert_ids >= 0).repeat_interleave(bt)
    assert (h[~real & in_segment] == 0).all(), "an expert's padding rows must be written as 0"

    # Down: the kernels' own hidden codes, with the NaN column zeroed so that only the weights' NaN row remains.
    _with_table(monkeypatch, cfg)
    hq = fp4_quant.quantize(h.nan_to_num(0.0, 0.0, 0.0), "nvfp4", "row")
    twf = tw.reshape(-1).float().contiguous()
    ys = []
    for slices in (False, True):
        y = torch.full((M * K, H), float("inf"), device="cuda")
        wg.down_kernel[(P // bt, H // cfg["block_n_down"])](
            hq.packed, hq.block_scale, hq.global_scale.reshape(-1), wdn.packed, wdn.block_scale,
            wdn.global_scale.reshape(-1), twf, y, sorted_ids, expert_ids, M * K, H, NI, BLOCK_T=bt,
            BLOCK_N=cfg["block_n_down"], BLOCK_K=cfg["block_k"], NUM_WARPS=cfg["num_warps"], SLICE_BUFFERS=slices,
            PDL=False, num_warps=cfg["num_warps"],
        )  # fmt: skip
        ys.append(y)
    assert torch.equal(ys[0].nan_to_num(7.0), ys[1].nan_to_num(7.0)), "the buffer layout changed the result"
    y = ys[0]
    hd = hq.dequantize().double()[real]
    want_y = torch.einsum("pi,phi->ph", hd, wdn.dequantize().double()[e]) * twf.double()[slots, None]
    got_y = y.double()[slots]
    assert torch.isnan(got_y[:, 3]).all()  # down row 3 reads the NaN scale
    ok = torch.arange(H, device="cuda") != 3
    assert not torch.isnan(got_y[:, ok]).any() and not torch.isinf(got_y[:, ok]).any()  # every slot written
    err = (got_y[:, ok] - want_y[:, ok]).abs().max() / want_y[:, ok].abs().max()
    assert err < 1e-5, f"down {cfg}: {err}"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm_90+ GPU")
@pytest.mark.parametrize("M", [192, 256, 512, 2048])
def test_wgmma_experts_match_the_other_kernels_and_torch_at_qwen3_shapes(M, monkeypatch):
    """Whole `experts_from_quantized` at Qwen3-30B-A3B expert shapes (decode batch 192, 256 and 512, a 2,048-token
    prefill chunk): the table's wgmma entry against the Triton kernels (held to the torch path by
    tests/kernels/test_fp4_moe.py) and the torch reference, and the hidden codes it quantized against the Triton
    kernels' (equal up to rare flips at a rounding boundary from the summation order); the loop variants and register
    caps give the entry's bits."""
    from trace_hf.kernels import fp4_quant

    E, H, NI, K = 128, 2048, 768, 8
    wgu, wdn = _packed(E, 2 * NI, H, seed=3), _packed(E, H, NI, seed=4)
    x = _input(M, H, seed=M)
    xq = fp4_quant.quantize(x, "nvfp4", "row")
    ids, tw = _routing(M, E, K, seed=10 + M)
    assert configs.wgmma_config(M * K, E, x.device) is not None, "the table must send these sizes to the wgmma kernels"
    y, hid = moe.experts_from_quantized(xq, ids, tw, wgu, wdn, return_hidden=True)
    cfg = configs.wgmma_config(M * K, E, x.device)
    for key in ("slice_buffers", "gate_first"):  # the other buffer layout, gate/up loop order
        _with_table(monkeypatch, dict(cfg, **{key: not cfg.get(key, False)}))
        assert torch.equal(moe.experts_from_quantized(xq, ids, tw, wgu, wdn), y), f"{key} changed the result"
    for gate_up, down in ((None, None), (72, 64), (80, 64), (96, 72), (128, 128)):  # caps: other code, the same bits
        _with_table(monkeypatch, dict(cfg, maxnreg=gate_up, maxnreg_down=down))
        assert torch.equal(moe.experts_from_quantized(xq, ids, tw, wgu, wdn), y), f"caps {gate_up}, {down}"
    for cfg in _entries():  # every entry gives the same numbers (same operands, its own summation order)
        _with_table(monkeypatch, cfg)
        y_other = moe.experts_from_quantized(xq, ids, tw, wgu, wdn)
        assert ((y_other - y).norm() / y.norm()).item() < 1e-3, cfg
    monkeypatch.setattr(configs, "WGMMA", [])
    monkeypatch.setattr(configs, "HOPPER", [])
    y_ref, hid_ref = moe.experts_from_quantized(xq, ids, tw, wgu, wdn, return_hidden=True)
    monkeypatch.undo()
    rel = ((y - y_ref).norm() / y_ref.norm()).item()
    assert rel < 1e-3, f"M={M}: {rel}"
    a, b = hid.q.packed[hid.positions()], hid_ref.q.packed[hid_ref.positions()]
    assert (a == b).float().mean().item() > 0.999
    if M <= 256:
        ref = moe.moe_experts_reference(x, ids, tw, wgu, wdn)
        out = y.sum(1)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm_90+ GPU")
@pytest.mark.parametrize("M", [192, 256, 512])
def test_fused_hidden_gives_the_same_bits(M, monkeypatch):
    """``fused_hidden`` (the hidden's quantization inside the gate/up launch, by the last program of each token
    block): on every real slot's row the codes, scale bytes and row scale that `fp4_quant.quantize` gives the
    launch's own fp32 hidden (a zero row, a row of ties, a NaN row among them), and the experts' output bit for bit
    against the entry without it, in two calls in a row (the block counters start from zero in each)."""
    from trace_hf.kernels import fp4_moe_wgmma as wg
    from trace_hf.kernels import fp4_quant
    from trace_hf.kernels.moe_align import moe_align

    E, H, NI, K = 128, 2048, 768, 8
    wgu, wdn = _packed(E, 2 * NI, H, seed=3), _packed(E, H, NI, seed=4)
    x = _input(M, H, seed=M)
    x[3, 5] = float("nan")
    xq = fp4_quant.quantize(x, "nvfp4", "row")
    ids, tw = _routing(M, E, K, seed=10 + M)
    cfg = configs.wgmma_config(M * K, E, x.device)
    _with_table(monkeypatch, cfg)
    y = moe.experts_from_quantized(xq, ids, tw, wgu, wdn)
    assert torch.isnan(y[3]).all() and not torch.isnan(y[4]).any()
    _with_table(monkeypatch, dict(cfg, fused_hidden=True))
    for _ in range(2):
        got = moe.experts_from_quantized(xq, ids, tw, wgu, wdn)
        assert torch.equal(got.view(torch.int32), y.view(torch.int32)), "fused_hidden changed the result"
    bt, bn, nw = cfg["block_t"], cfg["block_n_gate_up"], cfg["num_warps"]
    sorted_ids, expert_ids = moe_align(ids, E, bt)
    P = sorted_ids.numel()
    h = torch.zeros(P, NI, device="cuda")  # rows no program writes (blocks past the last segment) stay finite
    fused, grid = moe_common.fused_hidden(dict(cfg, fused_hidden=True), False, P, NI, bt, bn, x.device)
    wg.gate_up_kernel[grid](
        xq.packed, xq.block_scale, xq.global_scale.reshape(-1), wgu.packed, wgu.block_scale,
        wgu.global_scale.reshape(-1), h, sorted_ids, expert_ids, M * K, K, H, NI, BLOCK_T=bt, BLOCK_N=bn,
        BLOCK_K=cfg["block_k"], NUM_WARPS=nw, SLICE_BUFFERS=bool(cfg.get("slice_buffers")),
        GATE_FIRST=bool(cfg.get("gate_first")), PDL=False, num_warps=nw,
        maxnreg=configs.gate_up_cap(cfg, M * K, E, NI, x.device), **fused,
    )  # fmt: skip
    want = fp4_quant.quantize(h, "nvfp4", "row")
    real = sorted_ids < M * K
    assert torch.isnan(want.global_scale.reshape(-1)[real]).any()  # token 3's slots
    assert torch.equal(fused["hq_ptr"][real], want.packed[real])
    assert torch.equal(fused["hs_ptr"][real], want.block_scale[real])
    assert torch.equal(fused["hg_ptr"].reshape(-1)[real].view(torch.int32),
                       want.global_scale.reshape(-1)[real].view(torch.int32))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm_90+ GPU")
def test_module_uses_the_wgmma_kernels_and_matches_its_torch_path():
    """`TraceFP4Experts` (kernel="triton") at a size the table sends to wgmma: equal to its torch path, a NaN input
    row poisons exactly its own output row."""
    from torch import nn

    from trace_hf.quant.experts import TraceFP4Experts

    E, H, NI, K, M = 16, 256, 128, 4, 160
    g = torch.Generator().manual_seed(5)
    gu = nn.Parameter((torch.randn(E, 2 * NI, H, generator=g) * 0.1).cuda())
    d = nn.Parameter((torch.randn(E, H, NI, generator=g) * 0.1).cuda())
    ids, tw = _routing(M, E, K, seed=6)
    x = torch.randn(M, H, device="cuda")
    x[7, 3] = float("nan")
    assert configs.wgmma_config(M * K, E, x.device) is not None
    out = TraceFP4Experts(gu, d, nn.functional.silu, "nvfp4", "fp4", kernel="triton").eval()(x, ids, tw)
    ref = TraceFP4Experts(gu, d, nn.functional.silu, "nvfp4", "fp4", kernel="torch").eval()(x, ids, tw)
    assert torch.isnan(out[7]).all()
    keep = torch.arange(M, device="cuda") != 7
    assert not torch.isnan(out[keep]).any()
    assert ((out[keep] - ref[keep]).norm() / ref[keep].norm()).item() < 1e-3


def test_dispatch_by_slots_per_expert(monkeypatch):
    """`wgmma_config`: from the first entry's start (slots per expert) on, the entry whose range holds the call's slots per expert; past the
    decode kernels' last limit the first entry; below, on CPU, before sm_90, with an empty table or without Gluon,
    None (the decode kernels run)."""
    monkeypatch.setattr(configs, "INTERPRETED", False)
    cap = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cap["value"])
    dev = torch.device("cuda")
    (lo, first), (hi, second) = configs.WGMMA[:2]
    E = 128
    limit = configs.HOPPER[-1][0]
    assert configs.wgmma_config(lo * E - 1, E, dev) is None  # below 8 per expert (batch 64-127): the decode kernels
    assert configs.hopper_config(lo * E - 1, dev) == configs.HOPPER[-1][1]
    assert configs.wgmma_config(lo * E, E, dev) == first  # batch 128 at top-8, the decode kernels' last limit
    assert lo * E == limit
    assert configs.wgmma_config(limit + 1, E, dev) == first  # past them: wgmma, not the Triton kernels
    assert configs.wgmma_config(hi * E - 1, E, dev) == first
    assert configs.wgmma_config(hi * E, E, dev) == second
    assert configs.wgmma_config(16384 * 8, E, dev) == configs.WGMMA[-1][1]  # a 16K-token prefill
    assert configs.wgmma_config(lo * 16, 16, dev) == first  # by slots per expert, not slots: fewer experts, earlier
    assert configs.wgmma_config(1 << 20, E, torch.device("cpu")) is None
    cap["value"] = (8, 9)
    assert configs.wgmma_config(1 << 20, E, dev) is None
    cap["value"] = (9, 0)
    monkeypatch.setattr(configs, "HOPPER", [])  # "always the Triton kernels" below the wgmma range, as before
    assert configs.wgmma_config(lo * E - 1, E, dev) is None
    monkeypatch.setattr(configs, "WGMMA", [])
    assert configs.wgmma_config(1 << 20, E, dev) is None


def test_expected_token_blocks_match_random_routing():
    """`expected_token_blocks` (the blocks `moe_align` makes, which the gate/up cap plans waves for) against routing
    drawn at random the way a router with balanced load spreads its top-8 over 128 experts: within 2% from 4 to 48
    slots an expert, at 16- and 32-token blocks; and at least one block per expert hit, at most one per slot."""
    g = torch.Generator().manual_seed(0)
    E, K = 128, 8
    for rows in (64, 128, 192, 224, 256, 512, 768):
        for bt in (16, 32):
            ids = torch.rand(200, rows, E, generator=g).topk(K, dim=-1).indices  # 200 draws of distinct top-8
            counts = torch.nn.functional.one_hot(ids.flatten(1), E).sum(1)  # [draws, E]
            drawn = (-(-counts // bt)).sum(1).float().mean().item()
            want = configs.expected_token_blocks(rows * K, E, bt)
            assert abs(want - drawn) / drawn < 0.02, (rows, bt, want, drawn)
            assert E * (1 - math.exp(-rows * K / E)) - 1 <= want <= rows * K
    assert configs.expected_token_blocks(0, E, 16) == 0.0


def test_gate_up_cap_fills_whole_waves(monkeypatch):
    """`gate_up_cap`: an entry with one cap launches with it; with a tuple, the cap whose expected programs fill their
    last wave best, the first on a tie. On 132 SMs that is the faster cap at each batch timed in h200_102 (one
    expert call, 16-token blocks: 80 at batch 128, 160 and 224, 72 at 176, 192 and 208)."""
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(multi_processor_count=132)
    )
    dev = torch.device("cuda")
    t16 = {"block_t": 16, "block_n_gate_up": 64, "num_warps": 4, "maxnreg": (80, 72), "maxnreg_down": 64}
    faster = {128: 80, 160: 80, 176: 72, 192: 72, 208: 72, 224: 80}
    for rows, cap in faster.items():
        assert configs.gate_up_cap(t16, rows * 8, 128, 768, dev) == cap, rows
    assert configs.gate_up_cap(dict(t16, maxnreg=80), 192 * 8, 128, 768, dev) == 80
    assert configs.gate_up_cap(dict(t16, maxnreg=None), 192 * 8, 128, 768, dev) is None
    assert configs.gate_up_cap(dict(t16, maxnreg=(80, 80)), 192 * 8, 128, 768, dev) == 80
    for rows in range(129, 256):  # the pick never leaves a worse last wave than the entry's first cap
        cap = configs.gate_up_cap(t16, rows * 8, 128, 768, dev)
        progs = configs.expected_token_blocks(rows * 8, 128, 16) * 12

        def fill(c, progs=progs):
            w = progs / (configs.programs_per_sm(c, 4) * 132)
            return w / math.ceil(w)

        assert fill(cap) >= fill(80), rows


def test_wgmma_entries_are_checked():
    """Entries that the kernels cannot take are errors naming the fix; shapes the tiles do not divide fall back."""
    for cfg in _entries():
        assert configs.check_wgmma_entry(cfg, 2048, 768)  # Qwen3-30B-A3B
        assert not configs.check_wgmma_entry(cfg, 2048, 776)  # an expert width the tiles do not divide
    good = _entries()[0]
    for bad in (
        {"block_t": 12},
        {"block_k": 64},
        {"num_warps": 2},
        {"block_n_gate_up": 16 * good["num_warps"] + 8},
        {"maxnreg": 32},
        {"maxnreg_down": 300},
        {"maxnreg": (80, 40), "maxnreg_down": 64},
        {"maxnreg": (80, 72), "maxnreg_down": None},
        {"maxnreg": (), "maxnreg_down": 64},
    ):
        with pytest.raises(ValueError, match="WGMMA entry"):
            configs.check_wgmma_entry(dict(good, **bad), 2048, 768)


def test_interpreter_never_reaches_the_wgmma_kernels():
    """Under the interpreter (CI) the table is never consulted for a kernel: the Triton kernels serve every size."""
    if not common.INTERPRETED:
        pytest.skip("interpreter only")
    assert configs.wgmma_config(1 << 20, 128, torch.device("cpu")) is None


def _sass():
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this Triton has no bundled ptxas")
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from benchmarks.kernels import sass_counts

    return sass_counts


def _loop_counts_clean(kernel: str, sig: dict, consts: dict, num_warps: int, options: dict) -> tuple[int, dict]:
    """`sass_counts.loop_counts` of a `fp4_moe_wgmma` kernel in a fresh Python (`sass_counts.clean_python`: a Gluon
    compile fails in a process where the interpreter has run kernels)."""
    code = ("import json, sys; from benchmarks.kernels import sass_counts as s; "
            "from trace_hf.kernels import fp4_moe_wgmma as wg; a = [json.loads(x) for x in sys.argv[1:]]; "
            f"print(json.dumps(s.loop_counts(getattr(wg, {kernel!r}), a[0], a[1], a[2], **a[3])))")  # fmt: skip
    n, ops = _sass().clean_python(code, *(json.dumps(a) for a in (sig, consts, num_warps, options)))
    return n, ops


@pytest.mark.parametrize("slices", [False, True], ids=["one_buffer", "slice_buffers"])
@pytest.mark.parametrize("cfg", _entries(), ids=lambda c: f"t{c['block_t']}w{c['num_warps']}")
def test_wgmma_kernels_compile_for_sm90_without_spills(cfg, slices):
    """Every `WGMMA` entry of both kernels builds for sm_90 (Qwen3-30B-A3B shapes) with its wgmma instructions in the
    loop (8 per K tile, weight operand and 64-row tile: the eight K-slices), no register spills in the loop (with a
    register cap, at most 4 reloads and no stores), and under 4.5 instructions per
    FP4 element decoded (weights and the staged activations; the Triton kernels' loop: ~7); with ``slice_buffers`` at
    most 2 barriers per K tile."""
    sass = _sass()
    from trace_hf.kernels import fp4_moe_wgmma as wg

    bt, nw, bk = cfg["block_t"], cfg["num_warps"], cfg["block_k"]
    for fn, bn, sig, ops_per_tile in (
        (wg.gate_up_kernel, cfg["block_n_gate_up"], sass._signature("h_ptr", True), 16),
        (wg.down_kernel, cfg["block_n_down"], sass._signature("y_ptr", False), 8),
    ):
        consts = {"H": 2048, "NI": 768, "BLOCK_T": bt, "BLOCK_N": bn, "BLOCK_K": bk, "NUM_WARPS": nw,
                  "SLICE_BUFFERS": slices, "PDL": False}  # fmt: skip
        if fn is wg.gate_up_kernel:
            consts["GATE_FIRST"] = bool(cfg.get("gate_first", False))
        caps = [cfg.get("maxnreg_down") or _gate_up_caps(cfg)[0]] if fn is wg.down_kernel else _gate_up_caps(cfg)
        for cap in caps:
            regs = {"maxnreg": cap} if cap else {}
            n, ops = _loop_counts_clean(fn.__name__, sig, consts, nw, regs)
            if slices == cfg.get("slice_buffers", False):  # the entry as it runs: no spills, or with its register cap
                # (``maxnreg``) a few reloads of values kept across the loop (the decode entry: 2 per K tile) and no
                # stores (each gate/up cap the entry may pick, `gate_up_cap`)
                most = 4 if regs else 0
                assert "STL" not in ops and ops.get("LDL", 0) <= most, f"{fn.__name__} {cfg} cap {cap}: spills {ops}"
            m_reps = bn // (16 * nw)  # 64-row wgmma tiles per warpgroup
            assert ops.get("HGMMA", 0) == ops_per_tile * m_reps * bk // 128, f"{fn.__name__} {cfg}: {ops}"
            weights = (2 if ops_per_tile == 16 else 1) * bn * bk // (32 * nw)
            elements = weights + bt * bk // (32 * nw)
            assert n / elements < 4.5, f"{fn.__name__} {cfg} cap {cap}: {n / elements:.2f} instructions per element"
            if slices:  # the eight slice stores of a tile need no barrier between them: one before, one after
                assert ops.get("BAR", 0) <= 2, f"{fn.__name__} {cfg}: {ops}"


@pytest.mark.parametrize("cfg", _entries()[:2], ids=lambda c: f"t{c['block_t']}w{c['num_warps']}")
def test_fused_hidden_compiles_for_sm90(cfg):
    """The decode entries' gate/up with ``fused_hidden`` builds for sm_90 with their register caps, its main loop
    (the one with the wgmma instructions) the same as without it, opcode for opcode."""
    sass = _sass()
    code = ("import json, sys; from benchmarks.kernels import sass_counts as s; "
            "from trace_hf.kernels import fp4_moe_wgmma as wg; a = [json.loads(x) for x in sys.argv[1:]]; "
            "lines = s.compile_sass(wg.gate_up_kernel, a[0], a[1], a[2], **a[3]); "
            "print(json.dumps([ops for _, ops in s.all_loops(lines) if 'HGMMA' in ops]))")  # fmt: skip
    sig = sass._signature("h_ptr", True) | {"hq_ptr": "*u8", "hs_ptr": "*u8", "hg_ptr": "*fp32", "cnt_ptr": "*i32"}
    consts = {"H": 2048, "NI": 768, "BLOCK_T": cfg["block_t"], "BLOCK_N": cfg["block_n_gate_up"],
              "BLOCK_K": cfg["block_k"], "NUM_WARPS": cfg["num_warps"], "SLICE_BUFFERS": bool(cfg.get("slice_buffers")),
              "GATE_FIRST": bool(cfg.get("gate_first")), "PDL": False}  # fmt: skip
    cap = _gate_up_caps(cfg)[0]
    opts = {"maxnreg": cap} if cap else {}
    plain, fused = (
        sass.clean_python(code, *(json.dumps(a) for a in (sig, dict(consts, FUSED_HIDDEN=f), cfg["num_warps"],
                                                            opts)))
        for f in (False, True)
    )  # fmt: skip
    assert len(plain) == len(fused) == 1 and plain == fused, (plain, fused)


def test_sass_dump_covers_every_table_kernel():
    """`sass_counts.table_kernels` (what ``--dump`` compiles, to diff a change's machine code without a device): every
    `HOPPER` and `WGMMA` entry's gate/up, fused-hidden gate/up and down kernels, each under a name of its own, with
    constexprs the kernel takes and the entry's register caps."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from benchmarks.kernels import sass_counts

    kernels = list(sass_counts.table_kernels())
    names = [k[0] for k in kernels]
    assert len(set(names)) == len(names)
    for prefix, table in (("hopper", configs.HOPPER), ("wgmma", configs.WGMMA)):
        for i, (_, cfg) in enumerate(table):
            mine = [k for k in kernels if k[0].startswith(f"{prefix}{i}_")]
            assert {"gate_up", "down"} <= {"gate_up" if "gate_up" in k[0] else "down" for k in mine}
            assert any("fused" in k[0] for k in mine)
            caps = cfg.get("maxnreg")
            choices = prefix == "wgmma" and isinstance(caps, (tuple, list))
            for name, fn, sig, consts, nw, opts in mine:
                assert set(consts) <= set(fn.arg_names) and set(sig) <= set(fn.arg_names), name
                assert nw == cfg["num_warps"]
                if "down" in name:
                    cap = cfg.get("maxnreg_down") or (caps[0] if choices else caps)
                else:  # a gate/up kernel per cap that `gate_up_cap` may pick, named by it
                    cap = int(name.split("_cap")[1].split("_")[0]) if choices else caps
                assert opts == ({"maxnreg": cap} if cap else {}), name
            if choices:
                assert {f"wgmma{i}_gate_up_cap{c}" for c in caps} <= {k[0] for k in mine}


def test_hopper_ab_patches_the_wgmma_table():
    """`benchmarks/kernels/hopper_ab.py` patches `WGMMA` entries by their start (``WGMMA<from>``) or all (``WGMMA*``), or
    replaces the table (``WGMMA``); a start the table lacks is an error, and the `HOPPER` patch leaves these keys alone."""
    from benchmarks.kernels import hopper_ab

    table = [(16, {"block_t": 32}), (48, {"block_t": 64})]
    patch = {"WGMMA*": {"num_warps": 8}, "WGMMA48": {"block_t": 128}}
    assert hopper_ab.patched_wgmma(table, patch) == [(16, {"block_t": 32, "num_warps": 8}),
                                                     (48, {"block_t": 128, "num_warps": 8})]  # fmt: skip
    assert hopper_ab.patched_wgmma(table, {}) == table
    assert hopper_ab.patched_wgmma(table, {"WGMMA": [[8, {"block_t": 16}]]}) == [(8, {"block_t": 16})]  # a new table
    with pytest.raises(SystemExit, match="WGMMA entries"):
        hopper_ab.patched_wgmma(table, {"WGMMA32": {"block_t": 16}})
    assert hopper_ab.patched([(8, {"block_t": 8})], patch) == [(8, {"block_t": 8})]


# ----------------------------------------------------------------------------------------------------------------
# The decoding every Gluon kernel shares (`fp4_moe_hopper.decode8`), checked on CPU: its PTX text, run by a small
# interpreter of the eight instructions it uses, against the spec (`trace_hf.fp4`), for every code and scale byte.
# ----------------------------------------------------------------------------------------------------------------


def _f16_bits(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF


def _f16_of(bits: torch.Tensor) -> torch.Tensor:
    return (bits & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16)


def _run_ptx(text: str, regs: dict) -> dict:
    """Run the straight-line PTX of `decode8` on int64 tensors of 32-bit register values (a test model of the
    instructions' semantics: prmt's default mode, logical shifts, lop3's truth table, f16x2 arithmetic rounded to
    nearest, E4M3x2 to f16x2 in hardware, i.e. exact with 0x7F NaN)."""
    m32 = 0xFFFFFFFF

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else torch.tensor(int(tok, 0), dtype=torch.int64)

    for line in (ln.strip() for ln in text.splitlines()):
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.rstrip(";").split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):  # split a 32-bit register into its 16-bit halves
            halves, src = rest.rsplit(",", 1)
            lo, hi = (h.strip() for h in halves.strip("{} ").split(","))
            regs[lo], regs[hi] = val(src) & 0xFFFF, (val(src) >> 16) & 0xFFFF
            continue
        args = [a.strip() for a in rest.split(",")]
        d, srcs = args[0], [val(a) for a in args[1:]]
        if op == "prmt.b32":
            a, b, sel = srcs
            pool = (a & m32) | ((b & m32) << 32)
            out = torch.zeros_like(pool)
            for i in range(4):
                pick = (int(sel) >> (4 * i)) & 7
                out |= ((pool >> (8 * pick)) & 0xFF) << (8 * i)
            regs[d] = out
        elif op == "shl.b32":
            regs[d] = (srcs[0] << int(srcs[1])) & m32
        elif op == "shr.b32":
            regs[d] = (srcs[0] & m32) >> int(srcs[1])
        elif op == "and.b32":
            regs[d] = srcs[0] & srcs[1]
        elif op == "or.b32":
            regs[d] = srcs[0] | srcs[1]
        elif op == "mov.b32":
            regs[d] = srcs[0] & m32
        elif op == "lop3.b32":  # bit (a << 2 | b << 1 | c) of the table is the result for input bits a, b, c
            a, b, c, table = srcs
            out = torch.zeros_like(a)
            for i in range(8):
                if int(table) >> i & 1:
                    out |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
            regs[d] = out & m32
        elif op == "cvt.rn.f16x2.e4m3x2":
            x = srcs[0]
            lo, hi = (fp4.e4m3_decode(((x >> s) & 0xFF).to(torch.uint8)) for s in (0, 8))
            regs[d] = _f16_bits(lo) | (_f16_bits(hi) << 16)
        elif op == "mul.rn.f16x2":
            a, b = srcs
            lo = _f16_of(a).float() * _f16_of(b).float()  # products of two fp16 values are exact in fp32
            hi = _f16_of(a >> 16).float() * _f16_of(b >> 16).float()
            regs[d] = _f16_bits(lo) | (_f16_bits(hi) << 16)  # one rounding to fp16, as mul.rn.f16x2
        else:
            raise AssertionError(f"the test's PTX model lacks {op}")
    return regs


def test_decode8_ptx_gives_the_spec_values_for_every_code_and_scale():
    """`decode8` (a pair of uint32 code words and their two E4M3 scale bytes to eight fp16 pairs): pair j holds
    element j of each word, ``E2M1 * s * 2^-14`` exactly: every code (both zeros, the largest magnitude), every scale
    byte (zero, subnormal, the largest, 0x7F NaN); element j of word w is column 8w + j of the packed row, the K order
    the wgmma and mma.sync kernels give both operands."""
    hop = pytest.importorskip("trace_hf.kernels.gluon_common")
    g = torch.Generator().manual_seed(0)
    n = 4096
    words = torch.randint(0, 1 << 32, (n, 2), generator=g, dtype=torch.int64)
    words[:16, 0] = torch.arange(16).repeat_interleave(1) * 0x11111111  # word k: every nibble code k
    scales = torch.randint(0, 256, (n, 2), generator=g, dtype=torch.int64)
    scales[:256, 1] = torch.arange(256)  # every scale byte
    regs = {"$8": words[:, 0], "$9": words[:, 1], "$10": scales[:, 0], "$11": scales[:, 1]}
    out = _run_ptx(hop._decode8_ptx(), regs)
    # The spec: codes from the packed bytes (element 2b in byte b's low nibble), `fp4.e2m1_decode`, `fp4.e4m3_decode`.
    packed = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], -1).reshape(n, 8).to(torch.uint8)
    codes = fp4.unpack_codes(packed).reshape(n, 2, 8)  # [pair, word, element]
    want = fp4.e2m1_decode(codes).double() * fp4.e4m3_decode(scales.to(torch.uint8)).double()[:, :, None] * 2.0**-14
    for j in range(8):
        got = torch.stack([_f16_of(out[f"${j}"]), _f16_of(out[f"${j}"] >> 16)], -1).double()  # [pair, word]
        w = want[:, :, j]
        nan = torch.isnan(w)
        assert torch.equal(torch.isnan(got), nan), f"slice {j}: NaN where the scale is not 0x7F / 0xFF"
        assert torch.equal(got[~nan], w[~nan]), f"slice {j}: not the spec's value"
        assert torch.equal(torch.signbit(got[~nan]), torch.signbit(w[~nan])), f"slice {j}: the sign of a zero"
    assert nan.any() and (want == 0).any() and (want.abs() == 6 * 448 * 2.0**-14).any()  # the classes were hit


def _decode8_wrong_bits(text: str, words: torch.Tensor) -> int:
    """How many of the fp16 values that PTX ``text`` (`_decode8_ptx`'s registers) makes of the uint32 code word pairs
    ``words`` [n, 2] at scale byte 0x38 (1.0) differ in any bit from the spec's ``E2M1 * 2^-14`` (`fp4.e2m1_decode`)."""
    n = words.shape[0]
    one = torch.full((n,), 0x38, dtype=torch.int64)
    out = _run_ptx(text, {"$8": words[:, 0], "$9": words[:, 1], "$10": one, "$11": one})
    packed = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], -1).reshape(n, 8).to(torch.uint8)
    want = _f16_bits(fp4.e2m1_decode(fp4.unpack_codes(packed).reshape(n, 2, 8)).double() * 2.0**-14)
    got = torch.stack([torch.stack([out[f"${j}"] & 0xFFFF, out[f"${j}"] >> 16], -1) for j in range(8)], -1)
    return int((got != want).sum())


def test_decode8_nibbles_give_the_spec_bits_for_every_16_bit_half():
    """`fp4_moe_hopper.nibbles_spread_ptx` builds each fp16 pair from a register that bit-selects of neighbouring
    nibbles make, so one nibble's bits could leak into another's: every 16-bit pattern (every code at each of the four
    nibble positions next to every code of the other three) in each half of both words gives exactly the fp16 bits of
    the spec's ``E2M1 * 2^-14`` (sign of zero included), and the check finds a sequence with one wrong mask."""
    hop = pytest.importorskip("trace_hf.kernels.gluon_common")
    g = torch.Generator().manual_seed(1)
    every = torch.arange(1 << 16, dtype=torch.int64)
    perm = [torch.randperm(1 << 16, generator=g) for _ in range(2)]
    words = torch.stack([every | perm[0] << 16, perm[1] | every << 16], -1)  # each half of each word: every pattern
    text = hop._decode8_ptx()
    assert _decode8_wrong_bits(text, words) == 0
    for good, bad in (("0x8E008E00", "0x8E000E00"), ("0x07070707", "0x07070703"), ("0x0E0E0E0E", "0x0E0E0E06")):
        assert good in text
        assert _decode8_wrong_bits(text.replace(good, bad, 1), words) > 0, f"{good} -> {bad} went unnoticed"
