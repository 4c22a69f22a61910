# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Summarize Nsight Compute reports exported as CSV (``ncu --import R.ncu-rep --page raw --csv > R.raw.csv``): per
kernel, the numbers that say whether it waits on memory, on its own instruction stream or on latency.

    python -m benchmarks.kernels.ncu_summary outputs/ncu/*.raw.csv --out outputs/ncu/ncu_summary.json

Columns: duration; DRAM throughput (% of peak); bytes read from DRAM; warp instructions; issue slots busy (the
schedulers' issue rate); active warps per scheduler; the ALU and FMA pipes' utilization; and the top stall reasons
in cycles per issued instruction (``selected`` is the issue itself).
"""

from __future__ import annotations

import argparse
import csv
import json
import os


METRICS = {
    "us": ("gpu__time_duration.sum", 1e-3),
    "dram_pct": ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1),
    "dram_mb": ("dram__bytes_read.sum", 1e-6),
    "warp_inst_m": ("smsp__inst_executed.sum", 1e-6),
    "issue_pct": ("sm__inst_issued.avg.pct_of_peak_sustained_elapsed", 1),
    "warps_per_sched": ("smsp__warps_active.avg.per_cycle_active", 1),
    "alu_pct": ("sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active", 1),
    "fma_pct": ("sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active", 1),
    "regs": ("launch__registers_per_thread", 1),
    "grid": ("launch__grid_size", 1),
    "block": ("launch__block_size", 1),
}
STALL = "smsp__average_warps_issue_stalled_"
UNIT_SCALE = {"ns": 1, "us": 1e3, "ms": 1e6, "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}


def _num(value: str, unit: str, base_unit: str | None) -> float:
    v = float(value.replace(",", ""))
    return v * UNIT_SCALE[unit] / UNIT_SCALE[base_unit] if base_unit and unit in UNIT_SCALE else v


def summarize(path: str) -> list[dict]:
    """One record per kernel launch of a ``--page raw --csv`` export."""
    with open(path) as f:
        rows = [r for r in csv.reader(f) if r]
    start = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    hdr, units, data = rows[start], rows[start + 1], rows[start + 2 :]
    col = {h: i for i, h in enumerate(hdr)}
    base = {"us": "ns", "dram_mb": "byte"}
    out = []
    for r in data:
        rec = {"report": os.path.basename(path).split(".")[0], "kernel": r[col["Kernel Name"]].split("(")[0][:40]}
        for key, (metric, scale) in METRICS.items():
            if metric in col and r[col[metric]] not in ("", "n/a"):
                rec[key] = round(_num(r[col[metric]], units[col[metric]], base.get(key)) * scale, 3)
        stalls = {
            h[len(STALL) : -len("_per_issue_active.ratio")]: float(r[i])
            for h, i in col.items()
            if h.startswith(STALL) and h.endswith("_per_issue_active.ratio") and r[i] not in ("", "n/a")
        }
        rec["stalls"] = {k: round(v, 2) for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:5]}
        out.append(rec)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="+", help="ncu --page raw --csv exports")
    p.add_argument("--out", help="also write the records as JSON")
    p.add_argument("--kernels", default="", help="comma-separated substrings: keep only these kernels")
    args = p.parse_args(argv)
    keep = [k for k in args.kernels.split(",") if k]
    recs = [r for path in args.csv for r in summarize(path) if not keep or any(k in r["kernel"] for k in keep)]
    cols = ["report", "kernel", "us", "dram_pct", "dram_mb", "warp_inst_m", "issue_pct", "warps_per_sched",
            "alu_pct", "fma_pct", "regs", "grid", "block"]  # fmt: skip
    print("| " + " | ".join(cols + ["top stalls (cycles per issued instruction)"]) + " |")
    print("|" + " --- |" * (len(cols) + 1))
    for r in recs:
        stalls = ", ".join(f"{k} {v}" for k, v in r["stalls"].items())
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + f" | {stalls} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(recs, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
