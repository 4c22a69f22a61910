# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Instructions per FP4 element in the main loops of the decode kernels (routed-expert GEMMs, FP4-KV attention), and
per value in the quantization kernel, in sm_90 machine code, without a GPU.

    python -m benchmarks.kernels.sass_counts    # the Gluon kernels (experts, attention) and the Triton ones, ~1 minute
    python -m benchmarks.kernels.sass_counts --dump DIR   # every table kernel's whole SASS, to diff a change

Compiles each kernel for ``GPUTarget("cuda", 90, 32)`` with the installed Triton (its bundled ptxas), disassembles
the cubin with the bundled cuobjdump, finds the loop (the backward branch) and counts its instructions by opcode
(the quantization kernel has no loop: all of it). Why: it shows in seconds, without device time, what a layout or
decoding change does to the work per element (the Triton expert kernels' ~7 instructions per element made them
issue-bound; the Gluon ones at 3.1-4 still are from batch 16 on, by Nsight Compute, docs/lab-notes.md 2h), and
that a config neither spills nor loses its tensor-core MMAs. The H200 image has Triton 3.6; install that version
(for example with ``pip install --target``) to count exactly what runs there.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile


PTRS = ["a_ptr", "as_ptr", "ag_ptr", "w_ptr", "ws_ptr", "wg_ptr"]


def _signature(out_ptr: str, gate_up: bool) -> dict:
    sig = {p: ("*fp32" if p.endswith("g_ptr") else "*u8") for p in PTRS}
    if gate_up:
        sig |= {out_ptr: "*fp32", "sorted_ptr": "*i32", "expert_ptr": "*i32", "num_slots": "i32", "top_k": "i32"}
    else:
        sig |= {"tw_ptr": "*fp32", out_ptr: "*fp32", "sorted_ptr": "*i32", "expert_ptr": "*i32", "num_slots": "i32"}
    return sig


def _cuobjdump(flag: str, fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int, options: dict,
               divisible=("H", "NI", "K")) -> str:  # fmt: skip
    """``cuobjdump flag`` of ``fn`` compiled for sm_90; pointers (and the integer arguments ``divisible``) marked
    16-divisible, as Triton specializes them at launch; FMA contraction on unless ``options`` says otherwise, as the
    launches pin it (kernels/README.md). The cubin goes to a directory of its own: tests compile in several processes
    at once."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    given = set(signature) | set(constexprs)
    constexprs = {p.name: p.default for p in fn.params if p.has_default and p.name not in given} | constexprs
    sig = dict(signature) | dict.fromkeys(constexprs, "constexpr")
    sig = {a: sig[a] for a in fn.arg_names}  # in the kernel's argument order
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names
             if sig[a] != "constexpr" and (a.endswith("ptr") or a in divisible)}  # fmt: skip
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        Source = ASTSource
    k = triton.compile(Source(fn, sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True,
                                **options})  # fmt: skip
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory(prefix="trace_hf_sass_") as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        return subprocess.run([os.path.join(bindir, "cuobjdump"), flag, path], capture_output=True, text=True).stdout


def compile_sass(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 1, divisible=("H", "NI", "K"),
                 **options) -> list:  # fmt: skip
    """[(address, instruction)] of ``fn`` compiled for sm_90 (as `_cuobjdump`)."""
    sass = _cuobjdump("-sass", fn, signature, constexprs, num_warps, num_stages, options, divisible)
    return [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def resources(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 1, **options) -> dict:
    """``fn``'s sm_90 resources by ``cuobjdump -res-usage``: REG (registers per thread, which set the programs per
    SM), STACK and LOCAL (bytes per thread: spills), SHARED (static shared memory)."""
    usage = _cuobjdump("-res-usage", fn, signature, constexprs, num_warps, num_stages, options)
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage)}


def _opcodes(body: list, widths: bool = False) -> dict:
    """Instructions by opcode (predicates dropped); with ``widths`` their modifiers kept (``LDG.E.128``)."""
    ops = collections.Counter(
        op if widths else op.split(".")[0] for op in (re.sub(r"^@!?U?P\w+ ", "", t).split()[0] for t in body)
    )
    ops.pop("NOP", None)
    return dict(ops.most_common())


def loop_counts(
    fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 1, **options
) -> tuple[int, dict]:
    """(instructions, opcode counts) of the longest loop of ``fn`` compiled for sm_90 (``options``: compiler options
    such as ``maxnreg``)."""
    lines = compile_sass(fn, signature, constexprs, num_warps, num_stages, **options)
    return max(all_loops(lines), default=(0, {}), key=lambda b: b[0])


def all_loops(lines: list) -> list:
    """[(instructions, opcode counts)] of every loop (backward branch) of `compile_sass`'s ``lines``."""
    out = []
    for addr, text in lines:
        br = re.search(r"BRA (0x[0-9a-f]+)", text)
        if br and int(br.group(1), 16) < addr:
            body = [t for a, t in lines if int(br.group(1), 16) <= a <= addr]
            out.append((len(body), _opcodes(body)))
    return out


def quant_counts(K: int = 2048) -> list[dict]:
    """Instructions per value of the quantization kernel (`fp4_quant._fp4_kernel`, one tile per program and no loop:
    the whole kernel over the values one thread holds) for its three training paths on bf16 rows of ``K``, NVFP4
    with per-row scales, with the launch `fp4_quant.CONFIG` gives a large call."""
    from trace_hf.kernels import fp4_quant as Q

    sig = {"x_ptr": "*i16", "g_ptr": "*fp32", "sb_ptr": "*u8", "hb_ptr": "*u8", "q_ptr": "*u8", "out_ptr": "*i16",
           "ids_ptr": "*i32", "M": "i32", "K": "i32", "rows_per_g": "i32", "pad_id": "i32"}  # fmt: skip
    out = []
    for name, path, mode, outs in (
        ("quantize + hint recording", "quantize", 0, {"WRITE_Q": True, "WRITE_BITS": True, "WRITE_OUT": False}),
        ("nearest fake-quant, bf16 out", "fake", 0, {"WRITE_Q": False, "WRITE_BITS": False, "WRITE_OUT": True}),
        ("guided fake-quant, bf16 out", "guided_fake", 2, {"WRITE_Q": False, "WRITE_BITS": False, "WRITE_OUT": True}),
    ):
        block_m, block_k, _, warps = Q._tiles(1 << 16, K, 16, mode == 0, path)
        consts = {"MODE": mode, "NVFP4": True, "IN_KIND": 1, "OUT_KIND": 1, "BLOCK_M": block_m, "BLOCK_K": block_k,
                  "BS": 16, "ROW_IDS": False, **outs}  # fmt: skip
        ops = _opcodes([t for _, t in compile_sass(Q._fp4_kernel, sig, consts, warps, enable_fp_fusion=False)])
        out.append({"kernel": name, "tile": f"{block_m} x {block_k}, {warps} warps", "instructions": sum(ops.values()),
                    "elements": block_m * block_k // (32 * warps), "ops": ops})  # fmt: skip
    return out


CONFIG_NOTE = "Qwen3-30B-A3B heads (32 q / 4 KV of 128), fp4_attention.CONFIG['hopper']"


def attention_counts(
    block_t: int | None = None, prefetch: bool | None = None, stages: int | None = None
) -> tuple[int, int, dict]:
    """(loop instructions, K and V elements per thread per iteration, opcodes) of the Gluon FP4-KV decode attention
    at Qwen3-30B-A3B's head shapes (one warp per program); None: the committed ``CONFIG["hopper"]`` setting."""
    from trace_hf.kernels import fp4_attention as A
    from trace_hf.kernels import fp4_attention_hopper as hop

    bt = block_t or A.CONFIG["hopper"]["block_t"]
    prefetch = A.CONFIG["hopper"]["prefetch"] if prefetch is None else prefetch
    stages = A.CONFIG["hopper"]["stages"] if stages is None else stages
    sig = {"q_ptr": "*bf16", "k_ptr": "*u8", "ks_ptr": "*u8", "kg_ptr": "*fp32", "v_ptr": "*u8", "vs_ptr": "*u8",
           "vg_ptr": "*fp32", "len_ptr": "*i32", "o_ptr": "*fp32", "lse_ptr": "*fp32", "sm_scale": "fp32", "T": "i32",
           "chunk": "i32"}  # fmt: skip
    consts = {
        "HQ": 32,
        "HKV": 4,
        "S": 8,
        "D": 128,
        "GROUP": 8,
        "G_PAD": 8,
        "BLOCK_T": bt,
        "PREFETCH": prefetch,
        "STAGES": stages,
        "PDL": False,
    }
    n, ops = loop_counts(hop.attn_split_kernel, sig, consts, 1)
    return n, bt * 2 * 128 // 32, ops


def gluon_counts() -> list[dict]:
    """Loop counts of every `fp4_moe_configs.HOPPER` config of both expert kernels (under the entry's ``maxnreg``) and
    of the attention: records with the kernel, its tile, the instructions, the FP4 elements per thread per iteration,
    the opcodes, and for the experts the registers and programs per SM."""
    from trace_hf.kernels import fp4_moe_configs as configs
    from trace_hf.kernels import fp4_moe_hopper as hop

    out = []
    for _limit, c in configs.HOPPER:
        bt, bk, nw = c["block_t"], c["block_k"], c["num_warps"]
        cap = c.get("maxnreg")
        for name, fn, bn, sig, extra in (
            ("gluon gate/up", hop.gate_up_kernel, c["block_n_gate_up"], _signature("h_ptr", True),
             {"SPLIT_K": c.get("split_k", 1)}),
            ("gluon down", hop.down_kernel, c["block_n_down"], _signature("y_ptr", False),
             {"SPLIT_K": c.get("split_k_down", 1), "EARLY_WEIGHTS": False}),  # its loop (`early_weights_counts`)
        ):  # fmt: skip
            consts = {"H": 2048, "NI": 768, "BLOCK_T": bt, "BLOCK_N": bn, "BLOCK_K": bk, "NUM_WARPS": nw,
                      "X_SHARED": c.get("x_shared", False), "STAGES": c.get("stages", 0), "PDL": False}  # fmt: skip
            tile = (f"N {bn} K {bk} warps {nw}" + (" x shared" if consts["X_SHARED"] else "")
                    + (f" ring {consts['STAGES']}" if consts["STAGES"] else ""))  # fmt: skip
            per_thread = (2 if "gate" in name else 1) * bn * bk // (32 * nw)
            regs = {"maxnreg": cap} if cap else {}
            args = (fn, sig, extra | consts, nw)
            n, ops = loop_counts(*args, **regs)
            r = resources(*args, **regs)["REG"]
            out.append({"kernel": name, "tile": tile, "instructions": n, "elements": per_thread, "ops": ops,
                        "x_shared": consts["X_SHARED"], "registers": r, "num_warps": nw, "maxnreg": cap,
                        "programs_per_sm": configs.programs_per_sm(r, nw)})  # fmt: skip
    n, per_thread, ops = attention_counts()
    out.append(
        {"kernel": "gluon attention", "tile": CONFIG_NOTE, "instructions": n, "elements": per_thread, "ops": ops}
    )
    return out


def early_weights_counts(early: int) -> dict:
    """The down kernel of `HOPPER[0]` (batch 1) with ``early_weights`` ``early`` and PDL, compiled for sm_90: the
    full opcodes (``LDG.E.64``, ...) ahead of the PDL wait (``ACQBULK``), the instructions after it, the whole
    kernel's opcodes, and the tile's K tiles, weight rows per warp and code words per row of a tile. Why: ptxas
    could sink loads or the decoding below the wait, which would undo the point."""
    from trace_hf.kernels import fp4_moe_configs as configs
    from trace_hf.kernels import fp4_moe_hopper as hop

    c = configs.HOPPER[0][1]
    bn, bk, nw, split = c["block_n_down"], c["block_k"], c["num_warps"], c.get("split_k_down", 1)
    consts = {"H": 2048, "NI": 768, "SPLIT_K": split, "BLOCK_T": c["block_t"], "BLOCK_N": bn, "BLOCK_K": bk,
              "NUM_WARPS": nw, "X_SHARED": False, "STAGES": 0, "PDL": True, "EARLY_WEIGHTS": early}  # fmt: skip
    lines = [t for _, t in compile_sass(hop.down_kernel, _signature("y_ptr", False), consts, nw)]
    full = [re.sub(r"^@!?U?P\w+ ", "", t).split()[0] for t in lines]
    full = [op for op in full if op != "NOP"]
    wait = full.index("ACQBULK")
    return {
        "before_wait": dict(collections.Counter(full[:wait])),
        "after_wait": len(full) - wait - 1,
        "ops": _opcodes(lines),
        "k_tiles": 768 // split // bk,
        "rows_per_warp": bn // nw,
        "words": bk // 8,
    }


def gemv_early_counts(early: int, x_bcast: bool = False) -> dict:
    """`decode_ops._gemv_kernel` under the committed `decode_ops.GEMV` launch with ``EARLY`` ``early`` and PDL,
    compiled for sm_90 (bf16; K is not specialized): the full opcodes ahead of the PDL wait (``ACQBULK``), those
    after it, its registers, spills, programs per SM, and the weights per thread of one K tile. Why: the early
    weight loads help only if ptxas leaves them ahead of the wait, and only if they cost no programs per SM."""
    from trace_hf.kernels import decode_ops as D
    from trace_hf.kernels.fp4_moe_configs import programs_per_sm

    c = D.GEMV
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "K": "i32"}
    consts = {"BLOCK_N": c["block_n"], "BLOCK_K": c["block_k"], "PDL": True, "EARLY": early, "X_BCAST": x_bcast}
    args = (D._gemv_kernel, sig, consts, c["num_warps"], c["num_stages"])
    full = [re.sub(r"^@!?U?P\w+ ", "", t).split()[0] for _, t in compile_sass(*args)]
    full = [op for op in full if op != "NOP"]
    wait = full.index("ACQBULK")
    res = resources(*args)
    return {
        "before_wait": dict(collections.Counter(full[:wait])),
        "after_wait": dict(collections.Counter(full[wait + 1 :])),
        "registers": res["REG"],
        "spills": res.get("LOCAL", 0) + res.get("STACK", 0),
        "programs_per_sm": programs_per_sm(res["REG"], c["num_warps"]),
        "tile_weights_per_thread": c["block_n"] * c["block_k"] // (32 * c["num_warps"]),
    }


def table_kernels():
    """(name, kernel, signature, constexprs, num_warps, compile options) of every Gluon expert kernel as the tables
    launch it (Qwen3-30B-A3B shapes, PDL on): each `HOPPER` and `WGMMA` entry's gate/up (with and without the fused
    hidden quantization, and at each split-K the entry uses) and down kernels, under the entry's register caps."""
    from trace_hf.kernels import fp4_moe_configs as configs
    from trace_hf.kernels import fp4_moe_hopper as hop
    from trace_hf.kernels import fp4_moe_wgmma as wg

    fused = {"hq_ptr": "*u8", "hs_ptr": "*u8", "hg_ptr": "*fp32", "cnt_ptr": "*i32"}
    for i, (_limit, c) in enumerate(configs.HOPPER):
        tile = {"H": 2048, "NI": 768, "BLOCK_T": c["block_t"], "BLOCK_K": c["block_k"], "NUM_WARPS": c["num_warps"],
                "X_SHARED": c.get("x_shared", False), "STAGES": c.get("stages", 0), "PDL": True}  # fmt: skip
        cap, cap_down = c.get("maxnreg"), c.get("maxnreg_down") or c.get("maxnreg")
        for split in sorted({1, c.get("split_k", 1)}):
            for f in (False, True) if split == 1 else (False,):
                consts = (
                    tile | {"SPLIT_K": split, "BLOCK_N": c["block_n_gate_up"]} | ({"FUSED_HIDDEN": True} if f else {})
                )
                sig = _signature("h_ptr", True) | (fused if f else {})
                yield (f"hopper{i}_gate_up_split{split}{'_fused' if f else ''}", hop.gate_up_kernel, sig, consts,
                       c["num_warps"], {"maxnreg": cap} if cap else {})  # fmt: skip
        for split in sorted({1, c.get("split_k_down", 1)}):
            consts = tile | {"SPLIT_K": split, "BLOCK_N": c["block_n_down"],
                             "EARLY_WEIGHTS": int(c.get("early_weights", 0))}  # fmt: skip
            yield (f"hopper{i}_down_split{split}", hop.down_kernel, _signature("y_ptr", False), consts, c["num_warps"],
                   {"maxnreg": cap_down} if cap_down else {})  # fmt: skip
    for i, (_start, c) in enumerate(configs.WGMMA):
        tile = {"H": 2048, "NI": 768, "BLOCK_T": c["block_t"], "BLOCK_K": c["block_k"], "NUM_WARPS": c["num_warps"],
                "SLICE_BUFFERS": bool(c.get("slice_buffers")), "PDL": True}  # fmt: skip
        choices = isinstance(c.get("maxnreg"), (tuple, list))
        caps = list(c["maxnreg"]) if choices else [c.get("maxnreg")]
        cap_down = c.get("maxnreg_down") or caps[0]
        for cap in caps:  # each gate/up cap `gate_up_cap` may pick, named by it where there are several
            name = f"wgmma{i}_gate_up" + (f"_cap{cap}" if choices else "")
            for f in (False, True):
                consts = tile | {"BLOCK_N": c["block_n_gate_up"], "GATE_FIRST": bool(c.get("gate_first"))}
                consts |= {"FUSED_HIDDEN": True} if f else {}
                sig = _signature("h_ptr", True) | (fused if f else {})
                yield (f"{name}{'_fused' if f else ''}", wg.gate_up_kernel, sig, consts, c["num_warps"],
                       {"maxnreg": cap} if cap else {})  # fmt: skip
        yield (f"wgmma{i}_down", wg.down_kernel, _signature("y_ptr", False), tile | {"BLOCK_N": c["block_n_down"]},
               c["num_warps"], {"maxnreg": cap_down} if cap_down else {})  # fmt: skip


def dump(out_dir: str) -> list[str]:
    """Write the whole sm_90 SASS of each `table_kernels` kernel to ``out_dir``/<name>.sass (instructions only, one a
    line): run it before and after a change and diff the folders. Why: a refactor of the Gluon kernels whose machine
    code is unchanged needs no device time to show that it changes nothing."""
    os.makedirs(out_dir, exist_ok=True)
    names = []
    for name, fn, sig, consts, nw, opts in table_kernels():
        lines = compile_sass(fn, sig, consts, nw, **opts)
        with open(os.path.join(out_dir, f"{name}.sass"), "w") as f:
            f.write("\n".join(text for _, text in lines) + "\n")
        names.append(name)
    return names


def _top(ops: dict) -> dict:
    return dict(list(ops.items())[:8])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the Gluon kernels' records as JSON")
    p.add_argument("--dump", metavar="DIR", help="write every table kernel's whole SASS to DIR instead (`dump`)")
    args = p.parse_args(argv)
    if args.dump:
        print("\n".join(dump(args.dump)))
        return 0
    records = gluon_counts()
    if args.json:
        print(json.dumps(records))
        return 0
    from trace_hf.kernels import fp4_moe_configs as configs
    from trace_hf.kernels import fp4_moe_triton as moe

    print("kernel, tile: instructions in the loop / FP4 elements per thread per iteration = per element")
    for r in records:
        n, e = r["instructions"], r["elements"]
        regs = f", {r['registers']} registers ({r['programs_per_sm']} per SM)" if "registers" in r else ""
        print(f"{r['kernel']}, {r['tile']}{regs}: {n} / {e} = {n / e:.2f}  {_top(r['ops'])}")
    cfg = configs.launch_config(1024)  # the Triton kernels' decode config
    common = {"A_FP4": True, "W_FP4": True, "DOT_BF16": True, "HALVES": True, "PTX": True, "BLOCK_M": 16,
              "BLOCK_K": cfg["block_k"], "PDL": False}  # fmt: skip
    bn = cfg["block_n_down"]
    n, ops = loop_counts(moe._down_kernel, _signature("y_ptr", False) | {"H": "i32", "NI": "i32"}, common | {"BLOCK_N": bn}, cfg["num_warps"],
                         cfg["num_stages"])  # fmt: skip
    per_thread = bn * cfg["block_k"] // (32 * cfg["num_warps"])
    print(
        f"triton down (decode CONFIG), N {bn} K {cfg['block_k']}: {n} / {per_thread} = {n / per_thread:.2f}  {_top(ops)}"
    )
    print("quantization kernel, tile: instructions in the kernel / values per thread = per value")
    for r in quant_counts():
        n, e = r["instructions"], r["elements"]
        print(f"{r['kernel']}, {r['tile']}: {n} / {e} = {n / e:.1f}  {_top(r['ops'])}")
    return 0


def clean_python(code: str, *args: str):
    """What ``code`` prints last, as JSON, run with ``args`` in a fresh Python without ``TRITON_INTERPRET``, in the
    repository root. Why: Triton's interpreter leaves some of ``triton.language`` patched after it runs a kernel,
    and a Gluon compile in that process then fails; the CPU tests run kernels in the interpreter before they compile
    these."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=root,
                         check=False)  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"sm_90 compile in a clean Python failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_clean() -> list[dict]:
    """``gluon_counts()`` in a fresh Python (`clean_python`)."""
    return clean_python(
        "import json; from benchmarks.kernels import sass_counts as s; print(json.dumps(s.gluon_counts()))"
    )


if __name__ == "__main__":
    sys.exit(main())
