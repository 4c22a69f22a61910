# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""FP4 quantization kernels: achieved bandwidth against a device copy, and bit-exactness against the spec.

    python -m benchmarks.kernels.fp4_quant --out outputs/fp4_quant.json            # H200
    python -m benchmarks.kernels.fp4_quant --out outputs/fp4_quant.json --sweep    # also try launch configs (< 4 min)
    python -m benchmarks.kernels.fp4_quant --smoke --out /tmp/fp4_smoke.json       # CPU, interpreter, tiny shapes

Bytes are counted as what a kernel must move: input read plus outputs written (plus hints read for the guided
fake-quant).
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks import harness


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="path of the JSON with the numbers")
    p.add_argument("--smoke", action="store_true", help="tiny shapes; on CPU through TRITON_INTERPRET=1")
    p.add_argument("--sweep", action="store_true", help="also time other launch configs per kernel (CUDA)")
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--exact-values", type=int, default=1 << 21, help="random values per format for bit checks")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    env = harness.setup_device("fp4_quant.py", args.smoke)  # before triton is imported
    if env is None:
        return 2
    cuda = env.cuda
    import torch
    import triton

    from trace_hf import fp4
    from trace_hf.kernels import fp4_quant as K

    dev = env.device
    rows, cols = (64, 256) if args.smoke else (args.rows, args.cols)
    n_exact = 1 << 12 if args.smoke else args.exact_values

    def bench(fn) -> float:
        """Median seconds per call (on the CPU, one call after a warm-up call)."""
        if cuda:
            return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3
        return harness.time_per_call(fn, 1, warmup=1)

    results: dict = {"device": env.name, "smoke": args.smoke}
    results["versions"] = {"torch": torch.__version__, "triton": triton.__version__}

    # 1. Copy bandwidth: bytes read + written per second.
    n_copy = (1 << 29) if not args.smoke else (1 << 17)  # 512 MiB
    copy_bw = harness.copy_bandwidth(dev, n_copy)
    results["copy"] = {"bytes": 2 * n_copy, "seconds": 2 * n_copy / copy_bw, "bytes_per_s": copy_bw}

    # 2. Quantize with hint recording and guided fake-quant of a [rows, cols] bf16 activation (NVFP4, row scale).
    x = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16)
    q, h = K.quantize(x, "nvfp4", "row", return_hints=True)
    hint_bytes = h.mantissa_bits.numel() + h.block_scale.numel() + 4 * h.global_scale.numel()
    q_bytes = x.numel() * 2 + q.packed.numel() + hint_bytes  # x read; codes, scales, g and bits written
    fq_bytes = 2 * x.numel() * 2 + hint_bytes  # x read, hints read, values written
    cases = {
        "quantize_with_hints": (lambda: K.quantize(x, "nvfp4", "row", return_hints=True), q_bytes),
        "guided_fake_quantize": (lambda: K.fake_quantize(x, hints=h), fq_bytes),
        "fake_quantize": (lambda: K.fake_quantize(x, "nvfp4", "row"), 2 * x.numel() * 2),
    }
    paths = {"quantize_with_hints": "quantize", "guided_fake_quantize": "guided_fake", "fake_quantize": "fake"}
    results["kernels"] = {}
    for name, (fn, nbytes) in cases.items():
        t = bench(fn)
        results["kernels"][name] = {
            "shape": [rows, cols],
            "bytes": nbytes,
            "seconds": t,
            "bytes_per_s": nbytes / t,
            "fraction_of_copy": nbytes / t / copy_bw,
            "config": dict(K.CONFIG[paths[name]]),
        }
    if args.sweep and cuda:
        # Launch configs per kernel path (K.CONFIG[path]): elements per program, columns per program (ignored by
        # the row-scale quantize, whose programs span whole rows), warps. At most 24 per kernel, short timings.
        whole_row = {"quantize", "fake"}  # NVFP4 row scale: BLOCK_K is the whole row
        sweep = []
        for name, (fn, nbytes) in cases.items():
            path = paths[name]
            default = dict(K.CONFIG[path])
            block_ks = (default["block_k"],) if path in whole_row else (512, 2048)
            for tile in (2048, 4096, 8192, 16384):
                for block_k in block_ks:
                    for warps in (2, 4, 8) if path not in whole_row else (2, 4, 8, 16):
                        if tile < block_k or tile // 256 < warps:
                            continue
                        cfg = {"tile": tile, "block_k": block_k, "num_warps": warps}
                        with harness.override({"fp4_quant.CONFIG": {path: cfg}}):
                            t = triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median") * 1e-3
                        sweep.append({"kernel": name, "path": path, **cfg, "fraction": nbytes / t / copy_bw})
        results["sweep"] = sweep
        for name in cases:
            best = max((s for s in sweep if s["kernel"] == name), key=lambda s: s["fraction"])
            cfg = {k: best[k] for k in ("tile", "block_k", "num_warps")}
            print(f"sweep best {name}: {best['fraction']:.1%} of copy; pin in kernels/fp4_quant.py CONFIG: "
                  f'"{best["path"]}": {json.dumps(cfg)}')  # fmt: skip
    x = q = h = None  # free the activation

    # 3. Bit-exactness on this device: kernels vs the torch reference, mismatching elements per field.
    def diff(a, b) -> int:
        if a.dtype.is_floating_point:
            na, nb = torch.isnan(a), torch.isnan(b)
            ib = torch.int16 if a.element_size() == 2 else torch.int32
            a = torch.where(na, torch.zeros_like(a), a).view(ib)
            b = torch.where(nb, torch.zeros_like(b), b).view(ib)
            return int((na != nb).sum()) + int(((a != b) & ~na).sum())
        return int((a != b).sum())

    g = torch.Generator().manual_seed(0)
    exact = {}
    for fmt in ("nvfp4", "mxfp4"):
        r = max(1, n_exact // 1024)
        xe = torch.randn(r, 1024, generator=g) * torch.pow(10.0, torch.empty(r, 1).uniform_(-30, 30, generator=g))
        xe[0, 3] = float("nan")
        xe = xe.to(dev)
        ref = fp4.quantize(xe, fmt, "row", backend="torch")
        got, hk = K.quantize(xe, fmt, "row", return_hints=True)
        rh = fp4.extract_hints(ref)
        xp = xe * (1 + 0.01 * torch.randn(xe.shape, generator=g).to(dev))
        counts = {
            "codes": diff(got.packed, ref.packed),
            "block_scale": diff(got.block_scale, ref.block_scale),
            "global_scale": diff(got.global_scale, ref.global_scale),
            "hint_bits": diff(hk.mantissa_bits, rh.mantissa_bits),
            "dequantize": diff(K.dequantize(got), ref.dequantize()),
            "fake_quantize_bf16": diff(
                K.fake_quantize(xe.bfloat16(), fmt),
                fp4.quantize(xe.bfloat16(), fmt, backend="torch").dequantize(torch.bfloat16),
            ),
            "guided_codes": diff(
                K.guided_quantize(xp, rh).packed, fp4.guided_quantize(xp, rh, backend="torch").packed
            ),
        }
        # The spec run on CPU, for the record (torch on CUDA may round divisions differently: see the report).
        if cuda:
            ref_cpu = fp4.quantize(xe.cpu(), fmt, "row", backend="torch")
            counts["vs_cpu_reference_block_scale"] = diff(got.block_scale.cpu(), ref_cpu.block_scale)
            counts["vs_cpu_reference_global_scale"] = diff(got.global_scale.cpu(), ref_cpu.global_scale)
        exact[fmt] = {"values": xe.numel(), "mismatches": counts}
    results["bit_exact"] = exact

    # Report.
    print(f"device: {results['device']}   copy: {copy_bw / 1e9:8.1f} GB/s (read+write)")
    print(f"{'kernel':24s} {'shape':>14s} {'us':>10s} {'GB/s':>9s} {'of copy':>8s}")
    for name, k in results["kernels"].items():
        shape = "x".join(map(str, k["shape"]))
        us, gbs = k["seconds"] * 1e6, k["bytes_per_s"] / 1e9
        print(f"{name:24s} {shape:>14s} {us:10.1f} {gbs:9.1f} {k['fraction_of_copy']:8.1%}")
    for fmt, e in exact.items():
        fails = {k: v for k, v in e["mismatches"].items() if v}
        status = "PASS" if not any(v for k, v in fails.items() if not k.startswith("vs_cpu")) else "FAIL"
        print(f"bit-exact {fmt}: {status} over {e['values']} values; mismatching elements: {fails or 0}")
    harness.write_json(args.out, results, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
