# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The Gluon expert kernels' launches (grid, every argument by value, dtype, shape and stride, every keyword) as the
W4A4 dispatcher makes them on an sm_90 GPU, recorded on the CPU without running a kernel: with
``sass_counts --dump``, what shows that a refactor of the host side left the GPU's work unchanged, without device time.

    python -m benchmarks.kernels.gluon_launches --root OLD_TREE --out old.pt   # e.g. a `git worktree` of a commit
    python -m benchmarks.kernels.gluon_launches --root . --out new.pt
    python -m benchmarks.kernels.gluon_launches --compare old.pt new.pt        # exit 1 if a launch differs

The device is made to look like a 132-SM sm_90 GPU to the config tables (`HOPPER`, `WGMMA`; `GROUPED` off), the Gluon
kernels are replaced by recorders, the Triton kernels between them run in the interpreter, and output buffers start
zeroed so that what the down projection reads is the same in both trees. Batches 1-300 at top-8 of 8 experts cover
both Gluon backends (decode kernels, then wgmma), with and without the hidden activation returned.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import types


BATCHES = (1, 2, 8, 32, 96, 300)


def record(root: str) -> list:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, os.path.abspath(root))
    import torch

    empty = torch.empty
    torch.empty = lambda *a, **k: empty(*a, **k).zero_()
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(multi_processor_count=132)
    from trace_hf import fp4
    from trace_hf.kernels import fp4_moe as moe
    from trace_hf.kernels import fp4_moe_configs as configs

    cuda = types.SimpleNamespace(type="cuda", index=0)
    wgmma, hopper = configs.wgmma_config, configs.hopper_config
    configs.INTERPRETED = False
    moe.wgmma_config = lambda n, e, dev: wgmma(n, e, cuda)
    moe.hopper_config = lambda n, dev: hopper(n, cuda)
    moe.grouped_config = lambda *a, **k: None
    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, tuple(grid), args, kwargs))

    for name in ("fp4_moe_hopper", "fp4_moe_wgmma"):
        module = importlib.import_module(f"trace_hf.kernels.{name}")
        for attr, obj in list(vars(module).items()):
            if "JIT" in type(obj).__name__:
                setattr(module, attr, Recorder(f"{name}.{attr}"))
    g = torch.Generator().manual_seed(0)
    experts, width, inner = 8, 1024, 1024
    w_gate_up = fp4.quantize(torch.randn(experts, 2 * inner, width, generator=g), "nvfp4", "tensor", backend="torch")
    w_down = fp4.quantize(torch.randn(experts, width, inner, generator=g), "nvfp4", "tensor", backend="torch")
    out = []
    for m in BATCHES:
        xq = fp4.quantize(torch.randn(m, width, generator=g), "nvfp4", "row", backend="torch")
        ids = torch.stack([torch.randperm(experts, generator=g)[:8] for _ in range(m)]).to(torch.int32)
        weights = torch.rand(m, 8, generator=g)
        for return_hidden in (False, True):
            launches.clear()
            moe.experts_from_quantized(xq, ids, weights, w_gate_up, w_down, return_hidden=return_hidden)
            out.append((m, return_hidden, list(launches)))
    return out


def _same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (a.dtype, a.shape, a.stride())
            == (b.dtype, b.shape, b.stride()) and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        )  # fmt: skip
    return type(a) is type(b) and a == b


def compare(a: list, b: list) -> list[str]:
    """What differs between two recordings, one line per launch."""
    diffs = []
    for (m, rh, la), (m2, rh2, lb) in zip(a, b, strict=True):
        if (m, rh) != (m2, rh2) or len(la) != len(lb):
            diffs.append(f"batch {m} return_hidden={rh}: {len(la)} launches against {len(lb)}")
            continue
        for (na, ga, aa, ka), (nb, gb, ab, kb) in zip(la, lb, strict=True):
            args = [i for i, (x, y) in enumerate(zip(aa, ab)) if not _same(x, y)] + (
                [] if len(aa) == len(ab) else ["#"]
            )
            kw = sorted(k for k in set(ka) | set(kb) if k not in ka or k not in kb or not _same(ka[k], kb[k]))
            if na != nb or ga != gb or args or kw:
                diffs.append(f"batch {m} return_hidden={rh}: {na} {ga} / {nb} {gb}: args {args}, keywords {kw}")
    return diffs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", help="the source tree to record (holds trace_hf/ and kernels/)")
    p.add_argument("--out")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = p.parse_args(argv)
    import torch

    if args.compare:
        a, b = (torch.load(f, weights_only=False) for f in args.compare)
        diffs = compare(a, b)
        print("\n".join(diffs) or f"{sum(len(x[2]) for x in a)} Gluon launches, all identical")
        return 1 if diffs else 0
    if not (args.root and args.out):
        p.error("give --root and --out to record, or --compare A B")
    result = record(args.root)
    torch.save(result, args.out)
    print(f"{sum(len(x[2]) for x in result)} Gluon launches recorded to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
