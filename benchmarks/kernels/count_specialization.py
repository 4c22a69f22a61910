# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""What Triton's specialization of a token count buys each training-side kernel, in sm_90 machine code, without a GPU.

    python -m benchmarks.kernels.count_specialization

Triton compiles a variant of a kernel for each integer argument that is a multiple of 16 (and one where it is not);
a packed training forward's token count changes every call, so a count of new divisibility compiles the kernel again
mid-step (docs/lab-notes.md 33). Passing counts unspecialized (``do_not_specialize``) avoids that; this prints each
kernel's instructions and memory/MMA instructions with its counts marked 16-divisible against unmarked (what an
unspecialized argument compiles to), everything else as at launch: the cost of never specializing them. Compiled
with the installed Triton and its bundled ptxas (`sass_counts.compile_sass`).
"""

from __future__ import annotations

import argparse
import json
import sys


#: Memory and matrix instructions: where an alignment the compiler cannot prove shows (narrower loads).
MEMORY = ("LDG", "STG", "LDS", "STS", "LDGSTS", "HGMMA", "HMMA")


def kernels() -> list:
    """(name, kernel, signature, constexprs, other 16-divisible integers, counts, num_warps, num_stages, options) at
    Qwen3-30B-A3B's training shapes (hidden 2048, expert width 768, heads of 128), each as its launch sets it."""
    from trace_hf.kernels import fp4_hinted, fp4_moe_configs, fp4_moe_grouped, fp4_quant, rms_norm, rope

    out = []
    sig = {"x_ptr": "*i16", "g_ptr": "*fp32", "sb_ptr": "*u8", "hb_ptr": "*u8", "q_ptr": "*u8", "out_ptr": "*i16",
           "ids_ptr": "*i32", "M": "i32", "K": "i32", "rows_per_g": "i32", "pad_id": "i32"}  # fmt: skip
    bm, bk, _, warps = fp4_quant._tiles(1 << 15, 2048, 16, False, "guided_fake")
    consts = {"MODE": 2, "NVFP4": True, "IN_KIND": 1, "OUT_KIND": 1, "BLOCK_M": bm, "BLOCK_K": bk, "BS": 16,
              "ROW_IDS": False, "WRITE_Q": False, "WRITE_BITS": False, "WRITE_OUT": True}  # fmt: skip
    out.append(("fp4_quant._fp4_kernel, guided fake quantization", fp4_quant._fp4_kernel, sig, consts, ["K"],
                ["M", "rows_per_g", "pad_id"], warps, 1, {"enable_fp_fusion": False}))  # fmt: skip
    sig = {"x_ptr": "*i16", "has_ptr": "*u8", "hsb_ptr": "*u8", "hb_ptr": "*u8", "hg_ptr": "*fp32", "q_ptr": "*u8",
           "sb_ptr": "*u8", "g_ptr": "*fp32", "out_ptr": "*i16", "flips_ptr": "*i32", "M": "i32", "K": "i32"}  # fmt: skip
    bm, bk, _, warps = fp4_quant._tiles(1 << 15, 2048, 16, True, "guided_fake")
    consts = {"APPLY": True, "NVFP4": True, "IN_KIND": 1, "OUT_KIND": 1, "WRITE_Q": False, "WRITE_OUT": True,
              "BLOCK_M": bm, "BLOCK_K": bk, "BS": 16}  # fmt: skip
    out.append(("fp4_hinted._hinted_kernel, hinted fake quantization", fp4_hinted._hinted_kernel, sig, consts, ["K"],
                ["M"], warps, 1, {"enable_fp_fusion": False}))  # fmt: skip
    t = fp4_moe_configs.GROUPED["fp32"]
    sig = {"a_ptr": "*bf16", "w_ptr": "*bf16", "ag_ptr": "*fp32", "wg_ptr": "*fp32", "tw_ptr": "*fp32",
           "out_ptr": "*fp32", "sorted_ptr": "*i32", "expert_ptr": "*i32", "num_slots": "i32", "top_k": "i32",
           "N": "i32", "KD": "i32", "num_pid_m": "i32"}  # fmt: skip
    for gate_up in (True, False):
        consts = {"GATE_UP": gate_up, "DOT_BF16": fp4_moe_grouped.DOT_BF16, "BLOCK_M": t["block_m"],
                  "BLOCK_N": t["block_n_gate_up" if gate_up else "block_n_down"], "BLOCK_K": t["block_k"],
                  "GROUP_M": t["group_m"]}  # fmt: skip
        out.append((f"fp4_moe_grouped._grouped_gemm_kernel, {'gate/up' if gate_up else 'down'}",
                    fp4_moe_grouped._grouped_gemm_kernel, sig, consts, ["N", "KD", "top_k"], ["num_slots", "num_pid_m"],
                    t["num_warps"], t["num_stages"], {"enable_fp_fusion": False}))  # fmt: skip
    rows, bn, warps = rms_norm._launch(2048)
    flags = {"ZERO_CENTERED": False, "X_BF16": True, "Y_BF16": True, "ROWS": rows, "BN": bn}
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "rstd_ptr": "*fp32", "R": "i32", "N": "i32",
           "inv_n": "fp32", "eps": "fp32"}  # fmt: skip
    out.append(("rms_norm._forward_kernel", rms_norm._forward_kernel, sig, flags, ["N"], ["R"], warps, 1, {}))
    sig = {"dy_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "rstd_ptr": "*fp32", "dx_ptr": "*bf16",
           "dw_ptr": "*fp32", "R": "i32", "N": "i32", "inv_n": "fp32"}  # fmt: skip
    out.append(("rms_norm._backward_kernel", rms_norm._backward_kernel, sig, flags | {"HAS_DW": False}, ["N"], ["R"],
                warps, 1, {}))  # fmt: skip
    sig = {"x_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "y_ptr": "*bf16"}
    sig |= dict.fromkeys(["T", "H", "sxb", "sxh", "sxt", "syb", "syh", "syt", "scb", "sct"], "i32")
    consts = {"D": 128, "R": 128, "BH": 32, "BD": 128, "BACKWARD": False, "BF16": True}
    out.append(("rope._rope_kernel (32 query heads)", rope._rope_kernel, sig, consts,
                ["H", "sxb", "sxh", "syb", "syh", "scb", "sct"], ["T"], rope.CONFIG["num_warps"], 1,
                {"enable_fp_fusion": False}))  # fmt: skip
    return out


def compare() -> list[dict]:
    from benchmarks.kernels.sass_counts import _opcodes, compile_sass

    rows = []
    for name, fn, sig, consts, fixed, counts, warps, stages, opts in kernels():
        marked = _opcodes(
            [t for _, t in compile_sass(fn, sig, consts, warps, stages, divisible=(*fixed, *counts), **opts)], True
        )
        plain = _opcodes(
            [t for _, t in compile_sass(fn, sig, consts, warps, stages, divisible=tuple(fixed), **opts)], True
        )
        memory = [{k: v for k, v in sorted(o.items()) if k.split(".")[0] in MEMORY} for o in (marked, plain)]
        rows.append({"kernel": name, "counts": counts, "instructions_16_divisible": sum(marked.values()),
                     "instructions_unspecialized": sum(plain.values()), "memory_16_divisible": memory[0],
                     "memory_unspecialized": memory[1]})  # fmt: skip
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the records as JSON")
    args = p.parse_args(argv)
    rows = compare()
    if args.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        same = "the same" if r["memory_16_divisible"] == r["memory_unspecialized"] else "differ"
        print(f"{r['kernel']} ({', '.join(r['counts'])}): {r['instructions_16_divisible']} instructions with the counts "
              f"16-divisible, {r['instructions_unspecialized']} unspecialized; memory/MMA instructions {same}")  # fmt: skip
        if same == "differ":
            print(f"    16-divisible {r['memory_16_divisible']}\n    unspecialized {r['memory_unspecialized']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
