# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The Gluon expert GEMMs (`trace_hf.kernels.fp4_moe_hopper`, sm_90+) against the spec and the Triton kernels.

Gluon does not run in the interpreter, so the numerics are GPU tests: the sums are exact products added in fp32 in
another order than torch's, so the hidden activation must match an fp64 reference of the same dequantized operands
to fp32 rounding, and NaN scales must reach exactly the rows that read them. On the CPU the kernels are compiled
for sm_90 (Triton's bundled ptxas), so CI catches a kernel that no longer builds, spills or loses its tight loop.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from trace_hf import fp4


moe = pytest.importorskip("trace_hf.kernels.fp4_moe")
moe_common = pytest.importorskip("trace_hf.kernels.fp4_moe_common")
common = pytest.importorskip("trace_hf.kernels.common")
configs = pytest.importorskip("trace_hf.kernels.fp4_moe_configs")
moe_align = pytest.importorskip("trace_hf.kernels.moe_align")


def _hopper_gpu():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def _packed(E, N, K, seed, special=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(E, N, K, device="cuda", generator=g) * 0.05
    q = fp4.quantize(w, "nvfp4", "expert")
    if special:
        codes = q.packed.view(E, N, K // 2)
        codes[:, 0, :4] = 0x88  # -0 codes
        codes[:, 1, :] = 0x77  # +6 everywhere: the largest magnitude
        q.block_scale.view(E, N, K // 16)[:, 2, :] = torch.arange(1, 8, device="cuda", dtype=torch.uint8).repeat(
            K // 16 // 7 + 1
        )[: K // 16]  # subnormal E4M3 scales
        q.block_scale.view(E, N, K // 16)[:, 3, 1] = 0x7F  # NaN scale: row 3 of every expert
    return q


def _routing(M, E, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w, ids = torch.softmax(torch.randn(M, E, device="cuda", generator=g), -1).topk(K)
    return ids, w


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm_90+ GPU")
@pytest.mark.parametrize("M", [1, 5, 64])
def test_gate_up_matches_fp64_of_the_same_operands(M, monkeypatch):
    """The hidden activation before its quantization: every code and scale class (including -0, the largest code,
    subnormal scales and a NaN scale) decodes to the spec's value; only fp32 summation order differs."""
    from trace_hf.kernels import fp4_moe_hopper as hop
    from trace_hf.kernels import fp4_quant

    E, H, NI, K = 16, 512, 256, 4
    wgu = _packed(E, 2 * NI, H, seed=1, special=True)
    x = torch.randn(M, H, device="cuda")
    xq = fp4_quant.quantize(x, "nvfp4", "row")
    ids, tw = _routing(M, E, K, seed=M)
    for _, cfg in configs.HOPPER:
        bt = cfg["block_t"]
        sorted_ids, expert_ids = moe_align.moe_align(ids, E, bt)
        P = sorted_ids.numel()
        nw = cfg["num_warps"]
        outs = []
        # Activations decoded by every warp, or once into shared memory; weights from registers or a cp.async ring.
        for x_shared, stages in itertools.product((False, True), (0, 2, 3)):
            if stages and not x_shared:
                continue
            h = torch.full((P, NI), float("inf"), device="cuda")
            hop.gate_up_kernel[(P // bt, NI // cfg["block_n_gate_up"], 1)](
                xq.packed, xq.block_scale, xq.global_scale.reshape(-1), wgu.packed, wgu.block_scale,
                wgu.global_scale.reshape(-1), h, sorted_ids, expert_ids, M * K, K, H, NI, SPLIT_K=1,
                BLOCK_T=bt, BLOCK_N=cfg["block_n_gate_up"], BLOCK_K=cfg["block_k"], NUM_WARPS=nw,
                X_SHARED=x_shared, STAGES=stages, PDL=False, num_warps=nw,
            )  # fmt: skip
            outs.append(h)
        # Same operand values, same MMAs in the same order: the paths agree bit for bit (NaN where NaN).
        for other in outs[1:]:
            assert torch.equal(outs[0].nan_to_num(7.0), other.nan_to_num(7.0)), cfg
        xd = xq.dequantize().double()
        wd = wgu.dequantize().double()
        real = sorted_ids < M * K
        slots = sorted_ids[real].long()
        e = ids.reshape(-1)[slots]
        gu = torch.einsum("ph,pnh->pn", xd[slots // K], wd[e])
        gate, up = gu.chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
        got = h[real].double()
        nan_rows = torch.zeros(NI, dtype=torch.bool, device="cuda")
        nan_rows[3] = True  # gate row 3 reads the NaN scale; up rows start at NI (row NI + 3 is finite)
        assert torch.isnan(got[:, 3]).all() and torch.isnan(want[:, 3]).all()
        ok = ~nan_rows
        err = (got[:, ok] - want[:, ok]).abs().max() / want[:, ok].abs().max()
        assert err < 1e-5, f"{cfg}: {err}"
        in_segment = (expert_ids >= 0).repeat_interleave(bt)
        assert (h[~real & in_segment] == 0).all(), "an expert's padding rows must be written as 0"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm_90+ GPU")
def test_hopper_experts_match_triton_kernels_at_qwen3_shapes(monkeypatch):
    """Whole `experts_from_quantized` at Qwen3-30B-A3B expert shapes, Gluon against the Triton kernels (which
    tests/kernels/test_fp4_moe.py holds to the torch path), with the hidden codes it quantized."""
    from trace_hf.kernels import fp4_quant

    E, H, NI, K = 128, 2048, 768, 8
    wgu, wdn = _packed(E, 2 * NI, H, seed=2), _packed(E, H, NI, seed=3)
    for M in (1, 8, 64, 128):
        x = torch.randn(M, H, device="cuda")
        xq = fp4_quant.quantize(x, "nvfp4", "row")
        ids, tw = _routing(M, E, K, seed=10 + M)
        cfg = configs.hopper_config(M * K, x.device)
        assert cfg is not None
        y, hid = moe.experts_from_quantized(xq, ids, tw, wgu, wdn, return_hidden=True)
        # The other operand paths (activations decoded per warp or once into shared memory, weights from registers
        # (also with another down tile and register caps) or through a cp.async ring, or all of a down program's
        # weights loaded, or also decoded, before its PDL wait) give the same bits.
        for other in (
            {"x_shared": False, "stages": 0, "early_weights": 0},
            {"x_shared": True, "stages": 0, "early_weights": 0},
            {"x_shared": True, "stages": 3, "early_weights": 0},
            {
                "x_shared": True,
                "stages": 0,
                "early_weights": 0,
                "block_n_down": 64,
                "maxnreg": 128,
                "maxnreg_down": 80,
            },
            {"x_shared": False, "stages": 0, "early_weights": 1},
            {"x_shared": False, "stages": 0, "early_weights": 2, "maxnreg_down": 120},
        ):
            monkeypatch.setattr(configs, "HOPPER", [(1 << 62, cfg | other)])
            y_other, hid_other = moe.experts_from_quantized(xq, ids, tw, wgu, wdn, return_hidden=True)
            assert torch.equal(y, y_other), f"M={M}: {other} changed the result"
            a, b = hid.q.packed[hid.positions()], hid_other.q.packed[hid_other.positions()]
            assert torch.equal(a, b), f"M={M}: {other} changed the hidden codes"
        monkeypatch.setattr(configs, "HOPPER", [])
        y_ref, hid_ref = moe.experts_from_quantized(xq, ids, tw, wgu, wdn, return_hidden=True)
        monkeypatch.undo()
        # Per token (a split down projection returns each slot's partial sums side by side).
        y, y_ref = y.sum(1), y_ref.sum(1)
        rel = ((y - y_ref).norm() / y_ref.norm()).item()
        assert rel < 1e-3, f"M={M}: {rel}"
        # Hidden codes by slot: equal except rare rounding-boundary flips from the summation order.
        a, b = hid.q.packed[hid.positions()], hid_ref.q.packed[hid_ref.positions()]
        assert (a == b).float().mean().item() > 0.999


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm_90+ GPU")
def test_module_uses_the_hopper_kernels_and_matches_its_torch_path():
    from torch import nn

    from trace_hf.quant.experts import TraceFP4Experts

    E, H, NI, K, M = 16, 256, 128, 4, 40
    g = torch.Generator().manual_seed(5)
    gu = nn.Parameter((torch.randn(E, 2 * NI, H, generator=g) * 0.1).cuda())
    d = nn.Parameter((torch.randn(E, H, NI, generator=g) * 0.1).cuda())
    ids, tw = _routing(M, E, K, seed=6)
    x = torch.randn(M, H, device="cuda")
    x[7, 3] = float("nan")
    out = TraceFP4Experts(gu, d, nn.functional.silu, "nvfp4", "fp4", kernel="triton").eval()(x, ids, tw)
    ref = TraceFP4Experts(gu, d, nn.functional.silu, "nvfp4", "fp4", kernel="torch").eval()(x, ids, tw)
    assert configs.hopper_config(M * K, x.device) is not None
    assert torch.isnan(out[7]).all()
    keep = torch.arange(M, device="cuda") != 7
    assert ((out[keep] - ref[keep]).norm() / ref[keep].norm()).item() < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm_90+ GPU")
@pytest.mark.parametrize("M", [20, 128])
def test_fused_hidden_gives_the_same_bits(M, monkeypatch):
    """``fused_hidden`` on the entry of batch 20 and 128 (the hidden's quantization inside the gate/up launch, by the
    last program of each token block): on every real slot's row the codes, scale bytes and row scale that
    `fp4_quant.quantize` gives the launch's own fp32 hidden (a zero row and a NaN row among them), and the experts'
    output bit for bit against the entry without it, in two calls in a row."""
    from trace_hf.kernels import fp4_moe_hopper as hop
    from trace_hf.kernels import fp4_quant

    E, H, NI, K = 128, 2048, 768, 8
    wgu, wdn = _packed(E, 2 * NI, H, seed=2), _packed(E, H, NI, seed=3)
    x = torch.randn(M, H, device="cuda")
    x[1] = 0.0
    x[3, 5] = float("nan")
    xq = fp4_quant.quantize(x, "nvfp4", "row")
    ids, tw = _routing(M, E, K, seed=10 + M)
    cfg = configs.hopper_config(M * K, x.device)
    assert cfg.get("split_k", 1) == 1
    y = moe.experts_from_quantized(xq, ids, tw, wgu, wdn)
    assert torch.isnan(y[3]).all() and not torch.isnan(y[4]).any()
    monkeypatch.setattr(configs, "HOPPER", [(1 << 62, dict(cfg, fused_hidden=True))])
    for _ in range(2):
        got = moe.experts_from_quantized(xq, ids, tw, wgu, wdn)
        assert torch.equal(got.view(torch.int32), y.view(torch.int32)), "fused_hidden changed the result"
    bt, bn, nw = cfg["block_t"], cfg["block_n_gate_up"], cfg["num_warps"]
    sorted_ids, expert_ids = moe_align.moe_align(ids, E, bt)
    P = sorted_ids.numel()
    h = torch.zeros(P, NI, device="cuda")  # rows no program writes (blocks past the last segment) stay finite
    fused, grid = moe_common.fused_hidden(dict(cfg, fused_hidden=True), False, P, NI, bt, bn, x.device)
    hop.gate_up_kernel[grid + (1,)](
        xq.packed, xq.block_scale, xq.global_scale.reshape(-1), wgu.packed, wgu.block_scale,
        wgu.global_scale.reshape(-1), h, sorted_ids, expert_ids, M * K, K, H, NI, SPLIT_K=1, BLOCK_T=bt, BLOCK_N=bn,
        BLOCK_K=cfg["block_k"], NUM_WARPS=nw, X_SHARED=cfg.get("x_shared", False), STAGES=cfg.get("stages", 0),
        PDL=False, num_warps=nw, **fused,
    )  # fmt: skip
    want = fp4_quant.quantize(h, "nvfp4", "row")
    real = sorted_ids < M * K
    assert torch.isnan(want.global_scale.reshape(-1)[real]).any()  # token 3's slots
    assert torch.equal(fused["hq_ptr"][real], want.packed[real])
    assert torch.equal(fused["hs_ptr"][real], want.block_scale[real])
    assert torch.equal(fused["hg_ptr"].reshape(-1)[real].view(torch.int32),
                       want.global_scale.reshape(-1)[real].view(torch.int32))  # fmt: skip


def test_fused_hidden_compiles_for_sm90():
    """The gate/up kernel of each one-slice `HOPPER` entry with ``fused_hidden`` builds for sm_90, its main loop (the
    one with the MMAs) with the same MMAs and no spills."""
    import json
    import os

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this Triton has no bundled ptxas")
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from benchmarks.kernels import sass_counts as sass

    code = ("import json, sys; from benchmarks.kernels import sass_counts as s; "
            "from trace_hf.kernels import fp4_moe_hopper as hop; a = [json.loads(x) for x in sys.argv[1:]]; "
            "lines = s.compile_sass(hop.gate_up_kernel, a[0], a[1], a[2], **a[3]); "
            "print(json.dumps([s._opcodes([t for _, t in lines]), "
            "[ops for _, ops in s.all_loops(lines) if 'HMMA' in ops]]))")  # fmt: skip
    sig = sass._signature("h_ptr", True) | {"hq_ptr": "*u8", "hs_ptr": "*u8", "hg_ptr": "*fp32", "cnt_ptr": "*i32"}
    for _, c in configs.HOPPER:
        if c.get("split_k", 1) != 1:
            continue
        consts = {"H": 2048, "NI": 768, "SPLIT_K": 1, "BLOCK_T": c["block_t"], "BLOCK_N": c["block_n_gate_up"],
                  "BLOCK_K": c["block_k"], "NUM_WARPS": c["num_warps"], "X_SHARED": c.get("x_shared", False),
                  "STAGES": c.get("stages", 0), "PDL": False}  # fmt: skip
        (plain, plain_loops), (fused, fused_loops) = (
            sass.clean_python(code, *(json.dumps(a) for a in (sig, dict(consts, FUSED_HIDDEN=f), c["num_warps"],
                                                                {})))
            for f in (False, True)
        )  # fmt: skip
        assert fused.get("HMMA") == plain.get("HMMA"), (c, plain, fused)
        assert "STL" not in fused and "LDL" not in fused, f"{c}: spills {fused}"
        assert [o.get("HMMA") for o in fused_loops] == [o.get("HMMA") for o in plain_loops], c


def test_table_lookup_and_fallbacks(monkeypatch):
    """`hopper_config`: decode sizes get their `HOPPER` entry, prefill sizes and GPUs before sm_90 the Triton
    kernels (None); a Triton without Gluon's layouts falls back with a warning instead of failing."""
    monkeypatch.setattr(configs, "INTERPRETED", False)
    cap = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cap["value"])
    dev = torch.device("cuda")
    assert configs.hopper_config(8, dev) == configs.HOPPER[0][1]
    assert configs.hopper_config(9, dev) == configs.HOPPER[1][1]
    assert configs.hopper_config(configs.HOPPER[-1][0], dev) == configs.HOPPER[-1][1]
    assert configs.hopper_config(configs.HOPPER[-1][0] + 1, dev) is None
    assert configs.hopper_config(8, torch.device("cpu")) is None
    cap["value"] = (8, 0)
    assert configs.hopper_config(8, dev) is None
    cap["value"] = (9, 0)
    common.gluon_module.cache_clear()
    import sys

    import trace_hf.kernels

    monkeypatch.setitem(sys.modules, "trace_hf.kernels.fp4_moe_hopper", None)  # the import fails
    monkeypatch.delattr(trace_hf.kernels, "fp4_moe_hopper", raising=False)
    with pytest.warns(UserWarning, match="Gluon"):
        assert configs.hopper_config(8, dev) is None
    common.gluon_module.cache_clear()


def test_kernels_compile_for_sm90_without_spills(gluon_sass_counts):
    """Every `HOPPER` config of both kernels builds for sm_90 with a loop under 6 instructions per weight element
    and no register spills (the Triton kernels' loop: ~7); with ``x_shared`` the loop decodes no activations."""
    records = [r for r in gluon_sass_counts if r["kernel"] in ("gluon gate/up", "gluon down")]
    assert len(records) == 2 * len(configs.HOPPER)
    for r in records:
        ops, per_element = r["ops"], r["instructions"] / r["elements"]
        assert "LDL" not in ops and "STL" not in ops, f"{r['kernel']} {r['tile']}: spills {ops}"
        assert ops.get("HMMA", 0) > 0, f"{r['kernel']} {r['tile']}: no tensor-core MMA in the loop"
        assert per_element < 6.0, f"{r['kernel']} {r['tile']}: {per_element:.2f} instructions per element"
        if r["x_shared"]:  # the loop decodes weights only (one HMUL2 per fp16 pair) and reads x from shared memory
            assert ops.get("HMUL2") == r["elements"] // 2 and ops.get("LDSM", 0) > 0, f"{r['tile']}: {ops}"


def _sm90_counts(fn: str):
    """``sass_counts.<fn>()`` in a clean Python, or a skip where this Triton has no ptxas or Gluon MMA layouts."""
    import os

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this Triton has no bundled ptxas")
    pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere")
    from benchmarks.kernels import sass_counts

    return sass_counts.clean_python(
        f"import json; from benchmarks.kernels import sass_counts as s; print(json.dumps({fn}))"
    )


def test_early_down_weights_load_before_the_pdl_wait():
    """``early_weights`` (batch 1's down programs): every weight and scale-byte load is issued ahead of the PDL
    wait in the sm_90 code (with 2, every weight decoding multiply too, and half the instructions are left after
    it), with no spills, and the MMAs are the loop path's (8 per K tile and 16 weight rows)."""
    one, two = _sm90_counts("[s.early_weights_counts(1), s.early_weights_counts(2)]")
    for r in (one, two):
        words = r["k_tiles"] * r["rows_per_warp"] * r["words"] // 32  # uint32 code words per thread, 8-byte pairs
        assert r["before_wait"].get("LDG.E.64") == words // 2, r["before_wait"]
        assert r["before_wait"].get("LDG.E.U8") == words // 2, r["before_wait"]  # one scale byte per pair
        assert "LDL" not in r["ops"] and "STL" not in r["ops"], r["ops"]
        assert r["ops"].get("HMMA") == r["k_tiles"] * 8 * r["rows_per_warp"] // 16, r["ops"]
    # 2: one HMUL2 per weight fp16 pair (a word pair gives 8), all ahead of the wait; the rest after it halves.
    assert two["before_wait"].get("HMUL2") == words // 2 * 8, two["before_wait"]
    assert "HMUL2" not in one["before_wait"]
    assert two["after_wait"] < one["after_wait"] * 0.6, (one["after_wait"], two["after_wait"])


def test_hopper_entries_are_checked():
    """A `HOPPER` entry's ring without ``x_shared`` is an error naming the fix."""
    for _, cfg in configs.HOPPER:
        configs.check_hopper_entry(cfg)
    with pytest.raises(ValueError, match="stages"):
        configs.check_hopper_entry({"stages": 2})


def test_quantization_kernel_compiles_for_sm90_without_spills():
    """`sass_counts.quant_counts`: the quantization kernel's three training paths build for sm_90 from the kernel's
    whole signature (the padding-row ids included) without register spills."""
    records = _sm90_counts("s.quant_counts()")
    assert [r["kernel"] for r in records] == [
        "quantize + hint recording",
        "nearest fake-quant, bf16 out",
        "guided fake-quant, bf16 out",
    ]
    for r in records:
        assert r["instructions"] > 0 and "LDL" not in r["ops"] and "STL" not in r["ops"], r
