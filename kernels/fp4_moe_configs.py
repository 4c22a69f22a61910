# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Tuned launch tables of the routed-experts kernels (`fp4_moe` and its backends), and the rules that
pick an entry by the number of (token, slot) pairs a call serves. Kept apart from the kernels so that a sweep
(`benchmarks/kernels/fp4_moe_tune.py`) or an A/B run (`benchmarks/kernels/hopper_ab.py`, keys ``fp4_moe_configs.NAME``) patches
one place; the measurements behind each entry are in docs/lab-notes.md."""

from __future__ import annotations


if __name__.split(".")[0] == "kernels":
    raise ImportError("Import trace_hf.kernels.fp4_moe_configs (see kernels/README.md), not kernels.fp4_moe_configs.")

import functools  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402

from trace_hf.kernels.common import INTERPRETED, gluon_module  # noqa: E402


#: Launch configs. ``by_slots``: for packed FP4 weights, by the number of (token, slot) pairs they serve up to (the
#: last entry serves the rest); ``dense``: for dense weights (the BF16 baseline), which reach 81-91% of the copy
#: bandwidth with it from batch 16 on. BLOCK_M = 16 is the smallest tl.dot tile: decode rows are few, the kernels
#: are bound by weight bytes. ``halves``: FP4 operands as even/odd column halves (`load_halves`) instead of
#: interleaved tiles (`load_fp4_rows`); ``ptx``: halves decoded by `fp4_halves_f16` into fp16 operands (W4A4 on
#: the GPU only; otherwise the fp32 decoding); ``split_k``: gate/up programs per row block and column tile, each
#: over a slice of K (batch 1 has too few programs to fill the GPU), finished by `fp4_moe_common.down_input`; ``block_m``
#: (optional, default ``CONFIG["block_m"]``): token rows per expert block, which a prefill of thousands of tokens
#: wants larger (each block re-reads its expert's weights). The FP4 entries are the best of `benchmarks/kernels/fp4_moe_tune.py` on the
#: H200 (Qwen3-30B-A3B experts; docs/lab-notes.md): 41 us at batch 1, 252 us at batch 16 and 350 us at batch 64,
#: against 89, 510 and 762 us for the fp32 decoding.
_DENSE = {
    "block_n_gate_up": 32,
    "block_n_down": 64,
    "block_k": 128,
    "num_warps": 4,
    "num_stages": 3,
    "halves": False,
    "ptx": False,
    "split_k": 1,
}


_FP4 = {
    "block_n_gate_up": 128,
    "block_n_down": 256,
    "block_k": 64,
    "num_warps": 4,
    "num_stages": 2,
    "halves": True,
    "ptx": True,
    "split_k": 1,
}


#: From 16,384 (token, slot) pairs on (prefill chunks of 2,048 tokens or more), 128-row expert blocks: each block
#: re-reads its expert's weights, and 16-row ones took 10.8 ms for 8,192 tokens against 5.1 ms (docs/lab-notes.md 2e).
_PREFILL = dict(_FP4, block_m=128, block_n_gate_up=64, block_n_down=128, block_k=64, num_stages=3)


CONFIG = {
    "block_m": 16,
    "dense": _DENSE,
    "by_slots": [
        (8, dict(_FP4, block_n_gate_up=64, block_n_down=128, num_stages=3, split_k=4)),
        (16383, _FP4),
        (1 << 62, _PREFILL),
    ],
}


#: W4A4 on sm_90+: the Gluon kernels of `fp4_moe_hopper` (weights as the MMA's A operand, codes decoded in the
#: operand registers), by (token, slot) pairs served as ``by_slots``. ``block_t``: token rows per expert block (the
#: MMA's N, 8 or 16); ``block_n_*``: weight rows per program (16 per warp at least); ``block_k``: a multiple of 128
#: (16 code words, one MMA's K); ``split_k``: gate/up programs
#: per tile over slices of K, summed by `fp4_moe_common.down_input` (batch 1 has too few row blocks to fill the GPU);
#: ``split_k_down`` (default 1): down programs per tile over slices of K, whose partial sums the caller adds with the
#: slots' (`experts_from_quantized` returns them side by side; the decode step's next add + RMSNorm sums them; batch 1
#: with 2 slices: +0.9% decode, with 3: -1.5%, with 6: -9%, two rounds each, docs/lab-notes.md 10);
#: ``x_shared``: decode the program's activations once into shared memory instead of in every warp (a fifth of the
#: loop's instructions with 4 warps; one warp gains nothing); ``stages``: 0, or the depth of a cp.async ring in shared
#: memory that the weights come through (with ``x_shared``; batch 64: 2% faster, batch 16: 3% slower); ``maxnreg``
#: (optional): a register cap for both kernels (96, 5 programs per SM instead of 4: 4% slower at batch 64 and 128,
#: docs/lab-notes.md 9; the 256 entry's gate/up takes 136 registers uncapped, 3 programs per SM, and 128 under its cap,
#: 4, no spills); ``maxnreg_down`` (optional, default ``maxnreg``): the down kernel's own cap.
#: The decoding (`gluon_common.decode8`, every Gluon kernel): `nibbles_spread_ptx`, 3 integer instructions per fp16
#: pair where the one before it took 4, the same operand bits. sm_90 loops (Triton 3.6's ptxas, gate/up and down):
#: batch 1's entry 517 -> 437 and 310 -> 263, the 1024 entry 804 -> 676 and 809 -> 681; `WGMMA` (with its caps):
#: 16-token 520 -> 448 and 315 -> 275, 32-token 570 -> 488 (gate/up's 2 reloads a K tile gone) and 359 -> 311,
#: prefill 1,088 -> 928 and 652 -> 556; no spills. The decode step with it in both tables and the attention
#: (docs/lab-notes.md 13, two rounds): +1.3% at batch 1, +4.6% at 128, +2.7% at 256, +3.9% at 512.
#: ``early_weights`` (default 0; needs ``x_shared`` off and no ring): 1, each down program loads all of its weight
#: tiles (fully unrolled) before its PDL wait, so that under PDL they stream while the SiLU + quantization kernel
#: before it runs; 2, it also decodes them into MMA operands there, so that after the wait it only decodes the hidden
#: and multiplies (`fp4_moe_hopper._down_early_weights`; the same MMAs in the same order, the same bits). Batch 1's
#: entry, sm_90 code (`sass_counts.early_weights_counts`): 2 takes 127 registers, 120 under ``maxnreg_down`` 120
#: without spills, so that its 2,048 one-warp down programs fit the GPU beside the SiLU kernel's 64 programs of 8
#: warps; the decode step at batch 1: +3.0% over the entry without it (docs/lab-notes.md 13, two rounds).
#: ``fused_hidden`` (default False; with ``split_k`` 1, not with hints at the hidden): the hidden activation's
#: quantization inside the gate/up launch, by the last program of each token block (`gluon_common.
#: quantize_token_block`, the same bits on every real slot's row), instead of `fp4_quant.quantize`'s launch over all
#: [P, I] rows. At batch 128 (this table's 1024 entry) it lost 1.6% in the step (docs/lab-notes.md 13), so no entry
#: here has it.
#: `benchmarks/kernels/fp4_moe_tune.py --hopper` on the H200 (docs/lab-notes.md). Empty: always the Triton kernels.
_WIDE = {"block_t": 8, "block_n_gate_up": 64, "block_n_down": 64, "block_k": 256, "num_warps": 4, "x_shared": True}


HOPPER = [
    (8, {"block_t": 8, "block_n_gate_up": 16, "block_n_down": 16, "block_k": 128, "num_warps": 1, "split_k": 4,
         "split_k_down": 2, "early_weights": 2, "maxnreg_down": 120}),
    (256, dict(_WIDE, maxnreg=128)),
    (1024, dict(_WIDE, block_n_down=128, stages=2)),
]  # fmt: skip


#: Above the last `HOPPER` limit (prefill chunks) the Triton kernels run: 8-token blocks re-read each expert's
#: weights once per 8 tokens, which suits decode, not a prefill of hundreds of tokens per expert.


#: W4A4 on sm_90+ where each expert serves many tokens (decode past ~1,000 slots, prefill, training forwards): the
#: wgmma kernels of `fp4_moe_wgmma` (weights decoded once per token block into wgmma's register operand, activations
#: decoded once per K tile into shared memory). Entries ``(from, cfg)`` by (token, slot) pairs per expert
#: (``num_slots / num_experts``, the mean token block an expert needs), ascending: an entry serves from its ``from``
#: up to the next one's; below the first, `HOPPER` runs (past its last limit the first entry). The first ``from`` is 8
#: (batch 128): with fewer tokens per expert a 16-token block is mostly padding and the 8-token `HOPPER` kernels read
#: no more weight bytes (batch 64, below). ``block_t``: token rows per expert block (wgmma's N, a multiple of 8);
#: ``block_n_*``: weight rows per program (wgmma's M: a multiple of 16 * num_warps, 64 per warpgroup); ``block_k``: 128 (16 code words per row; 256
#: spills in gate/up). Gate/up holds two accumulators: ``block_t`` 64 at most (128 does not compile).
#: ``slice_buffers`` (default False): one shared-memory allocation per activation K-slice, which takes 7 of the 9
#: barriers out of each K tile of the loop (`fp4_moe_wgmma._x_smem`); same operations otherwise, same bits. In the
#: decode step it gained 0.2% at 256 rows and 0.4% at 512 (two rounds each, docs/lab-notes.md 18f), so the decode entry
#: has it; the prefill entry, not measured with it, does not. Empty: never.
#: The entries are the best of `benchmarks/kernels/fp4_moe_tune.py --wgmma` on the H200 (Qwen3-30B-A3B experts; runs k31_1 and
#: k31_2, docs/lab-notes.md section 18): decode, 16-47 slots per expert (batch 256-767 at top-8): 32-token blocks,
#: 64-row programs of 4 warps (batch 256: 243 us, 512: 345 us; 64-token blocks 338-361 us, 8 warps 282-420 us);
#: prefill, 48+ per expert: 64-token blocks, 128-row programs of 4 warps (a 16,384-token prefill layer: 5.2 ms; 8
#: warps 6.3 ms, 64 rows 5.6-5.7 ms, 32-token blocks 6.5 ms). A cp.async weight ring and a 256-wide down K tile
#: were slower at every size (k31_2) and are not built. Below 16 per expert, past the `HOPPER` limit (batch 129-255):
#: 16-token blocks, 3.0% faster than 32-token ones in the decode step at batch 192 (12 per expert; 11,549 against
#: 11,213 tokens/s, two rounds); at batch 128 (8 per expert) the decode kernels stay (190 us a layer
#: against 206 us for 16-token wgmma blocks, and 9,523 against 9,035 tokens/s in the step, docs/lab-notes.md 9).
#: ``gate_first`` (default False): gate/up waits for gate's MMAs before it decodes up's weights, so one decoded
#: weight tile is live instead of two (sm_90 code, 32-token blocks: 134 registers instead of 161, the same
#: instructions, the same MMAs in the same order, the same bits); ``maxnreg`` (default none): a register cap per
#: thread for both kernels; ``maxnreg_down`` (default ``maxnreg``): the down kernel's own cap. Nsight Compute found
#: the decode entry's gate/up waiting on its loads (long scoreboard) with 2.85 warps per scheduler at 161 registers
#: (3 programs per SM); with ``gate_first`` and a cap of 128, 8 bytes of spills, 4 programs fit, and the
#: decode step gained 5.5% at batch 192, 3.4% at 256 and 2.9% at 512 (two rounds each, docs/lab-notes.md 9; one layer at
#: 512: 326.5 against 343.4 us). ``gate_first`` alone lost at 256 and 512 (-0.8%, -0.7%), and the cap alone spills 104
#: bytes at 32-token blocks. Lower caps, found with Triton 3.6's ptxas (which then
#: allocates fewer registers with no or 2 reloads a K tile): gate/up 96 and down 72 at 32-token blocks (5 and 7
#: programs per SM), 80 and 64 at 16-token blocks (6 and 8): a further +2.3% at batch 192, +1.9% at 256 and +3.9% at
#: 512 (two rounds each, docs/lab-notes.md 9; down's caps alone: +0.3%, +2.2%, +1.8%). The prefill entry (255 registers)
#: is bound by its MMAs. ``fused_hidden``: as in `HOPPER`; with 32-token blocks, +0.7% in the step at batch 256 (16 per
#: expert, blocks half full) and -1.5% at 512 (32 per expert: the last program of a full block quantizes twice the
#: rows), docs/lab-notes.md 13, two rounds each; so it serves 16-23 per expert (the crossover between the two measured
#: points is not measured). Batch 128 (8 per expert, the last `HOPPER` limit) now runs the 16-token entry with
#: ``fused_hidden`` (the first entry): one layer 165.9 us against `HOPPER[2]`'s 180.6 (16-token without it 168.1, with a
#: 72-register gate/up cap 174.2), the decode step +5.2% (10,608 against 10,076-10,087 tokens/s, two rounds,
#: docs/lab-notes.md 13); batch 64 stays on `HOPPER` (4 per expert: 157.8 against 140.2 us). With the decoding of
#: `HOPPER`'s note the 16-token blocks' fewer weight decodes per layer now pay, which they did not before it (206
#: against 190 us, docs/lab-notes.md 13). 12-15 per expert (batch 192) keeps the entry without it (not measured). Since
#: the separate quantization skips `moe_align`'s padding rows (`fp4_quant.quantize` with ``row_ids``: at 256 rows, 2,048
#: slots in a static 6,016 rows), no entry has ``fused_hidden``: without it, +1.1% in the decode step at batch 128 and
#: +2.5% at 256 (two rounds each, docs/lab-notes.md 16), so 8-15 and 16-47 per expert are one entry each.
#: ``maxnreg`` as a tuple: the gate/up caps to choose from per call (`gate_up_cap`), the one whose programs fill their
#: last wave best (``maxnreg_down`` then set). A decode step's gate/up runs ~2 waves of programs, so where the last
#: wave is a sliver it costs almost a whole program's time: one expert call (docs/lab-notes.md 17, 16-token entry) took
#: 164.8, 167.0, 182.5, 184.7, 189.1, 195.6 us at batch 128, 160, 176, 192, 208, 224 under a cap of 80 (6 programs an
#: SM) and 170.4, 173.8, 174.8, 176.3, 180.1, 201.6 under 72 (7; 71 registers, no spills, the same loop): steps where
#: the expected program count passes a multiple of 792 and 924 (132 SMs). The rule picks the faster cap at all six
#: batches. Decode step at 192 rows, 72 against 80: 14,064 / 14,097 against 13,506 / 13,523 tokens/s (+4.2%; again
#: +4.3% in a later run); at 128, 80 is kept (72: -2.4%). The 32-token entry keeps one cap: 80 against 96 gained
#: 1.8-2.1% at 256 rows but lost 0.9-1.1% at 512 (21,692 / 21,653 against 21,886 / 21,901, docs/lab-notes.md 17),
#: where the rule would pick 80 (2.82 waves against 3.38): there a second block of an expert re-reads weights its
#: first block just read (L2), so its programs are not a wave's worth of time, and 80 reloads 14 values a K tile.
WGMMA = [
    (8, {"block_t": 16, "block_n_gate_up": 64, "block_n_down": 64, "block_k": 128, "num_warps": 4,
         "slice_buffers": True, "gate_first": True, "maxnreg": (80, 72), "maxnreg_down": 64}),
    (16, {"block_t": 32, "block_n_gate_up": 64, "block_n_down": 64, "block_k": 128, "num_warps": 4,
          "slice_buffers": True, "gate_first": True, "maxnreg": 96, "maxnreg_down": 72}),
    (48, {"block_t": 64, "block_n_gate_up": 128, "block_n_down": 128, "block_k": 128, "num_warps": 4}),
]  # fmt: skip


def wgmma_config(num_slots: int, num_experts: int, device: torch.device) -> dict | None:
    """The `WGMMA` entry for a W4A4 call of ``num_slots`` (token, slot) pairs over ``num_experts`` experts on an
    sm_90+ GPU, or None (the decode kernels or the Triton kernels run). Past the last `HOPPER` limit, below the first
    ``from`` (Qwen3-30B-A3B: 1,025-2,047 pairs), the first entry: its blocks cover every expert once, as at its
    ``from``, where it is twice as fast as the Triton kernels that would run instead."""
    per_expert = num_slots / max(num_experts, 1)
    cfg = WGMMA[0][1] if WGMMA and HOPPER and num_slots > HOPPER[-1][0] else None
    for start, entry in WGMMA:
        if per_expert >= start:
            cfg = entry
    if cfg is None or INTERPRETED or device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return None
    return cfg if gluon_module("fp4_moe_wgmma") is not None else None


def programs_per_sm(registers: int, num_warps: int) -> int:
    """Programs of ``num_warps`` warps that an sm_90 SM's 64K registers hold at ``registers`` per thread (allocated
    per warp in units of 256), at most 32 programs and 64 warps."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(65536 // (per_warp * num_warps), 32, 64 // num_warps)


@functools.lru_cache(maxsize=256)
def expected_token_blocks(num_slots: int, num_experts: int, block_t: int) -> float:
    """The token blocks `moe_align` makes on average when ``num_slots`` slots fall on ``num_experts`` experts evenly at
    random (Poisson per expert): sum over experts of E[ceil(n / block_t)]. Why: a CUDA graph launches the static
    worst-case grid, and how many of its programs do work is known only on the device; this is the count to plan
    waves for (a trained router's skew makes a few more blocks)."""
    lam = num_slots / max(num_experts, 1)
    if lam <= 0:
        return 0.0
    lo, hi = max(0, int(lam - 12 * lam**0.5) - 8), int(lam + 12 * lam**0.5) + 8
    mean = sum(math.exp(n * math.log(lam) - lam - math.lgamma(n + 1)) * -(-n // block_t) for n in range(lo, hi + 1))
    return num_experts * mean


def gate_up_cap(cfg: dict, num_slots: int, num_experts: int, width: int, device: torch.device) -> int | None:
    """The gate/up kernel's register cap for a `WGMMA` entry's call: ``maxnreg``, or where it is a tuple, the cap whose
    programs (`expected_token_blocks` x ``width / block_n_gate_up``) fill their last wave on ``device``'s SMs best,
    the first on a tie (`WGMMA`'s note has the measurements)."""
    caps = cfg.get("maxnreg")
    if not isinstance(caps, (tuple, list)):
        return caps
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = expected_token_blocks(num_slots, num_experts, cfg["block_t"]) * (width // cfg["block_n_gate_up"])

    def fill(cap: int) -> float:
        waves = programs / (programs_per_sm(cap, cfg["num_warps"]) * sms)
        return waves / max(math.ceil(waves), 1)

    return max(caps, key=fill)


#: W4A4 where each expert serves so many tokens that the GEMMs are bound by compute, not bytes (prefill): Hopper has no
#: FP4 MMA, so `fp4_moe_grouped` decodes each weight once per call to bf16 (exact; the global scales stay in
#: the epilogues) and multiplies with torch's grouped GEMM (cutlass wgmma at the bf16 rate), where the wgmma kernels
#: above re-decode each weight once per 64-token block. Its GEMM sums are rounded to bf16 before the epilogues (a
#: hidden code in ~1-2% flips against fp32 sums), so it runs only for calls that ask (``bf16_sums=True``, from
#: `TraceFP4Config.prefill_bf16_gemms`, off by default: it raised trace/kl_rollout_train ~14%, docs/lab-notes.md 8).
#: ``from``: (token, slot) pairs per expert from which it runs (sm_90+, CUDA); ``block_m``: rows of `moe_align`'s
#: expert segments (grouped GEMM groups start on multiples of it); ``decode_rows``: rows per program of the bf16
#: decoding. Measured (`fp4_moe_tune.py --grouped`, docs/lab-notes.md 8, one Qwen3-30B-A3B layer): 256 per
#: expert (4,096 tokens) 1.67 ms against the wgmma kernels' 1.54-1.55, 512 (8,192) 2.45 ms, 1,024 (16,384) 3.97-4.02
#: against 5.18 ms (transformers' BF16 grouped_mm experts: 1.49, 2.66 and 4.87-4.96 ms); the crossover, interpolated,
#: near 335. Empty: never.
#: ``fp32_sums``: calls that do not ask for bf16 sums (the default forward) take the
#: grouped path too, with Triton's grouped GEMMs (`fp4_moe_grouped._grouped_gemm_kernel`) on the same decoded operands in place
#: of torch's: fp32 accumulators to the epilogues, the function of the wgmma kernels (`moe_experts_reference` without
#: ``gemm_dtype``), sums in another order. torch's grouped GEMM cannot do that: with an fp32 ``out_dtype`` it falls
#: back to one ``mm`` per expert after a host sync (aten GroupedBlas.cpp, torch 2.11). ``fp32``: that GEMM's tiles
#: (``block_m``: rows of `moe_align`'s segments and of a tile; ``group_m``: row tiles that run next to each other, so
#: an expert's rows and weights stay in L2); `check_grouped_fp32` says which shapes they divide. On the H200
#: (docs/lab-notes.md 11), one 16,384-token layer: 3,526 us with these tiles (3,755 with 128-wide down tiles), against
#: 3,997 for torch's bf16 grouped GEMM and 5,198 for the wgmma kernels; the 48-layer 16K prefill 657 -> 591 ms (with the
#: one-launch cache load), BF16 571.
GROUPED = {
    "from": 384,
    "block_m": 16,
    "decode_rows": 16,
    "fp32_sums": True,
    "fp32": {"block_m": 128, "block_n_gate_up": 128, "block_n_down": 256, "block_k": 64, "group_m": 8,
             "num_warps": 8, "num_stages": 3},
}  # fmt: skip


#: `moe_align` above its one-launch kernel's size (a prefill: 131,072 slots at 16,384 tokens). ``chunked``: the
#: layout from per-chunk counts, one program's scan and a placement by rank within the chunk
#: (`moe_align._align_chunks`, 4 launches, the torch backend's bits), in place of torch's ~20 launches around a
#: stable ``argsort``, whose cub radix sort takes all 64 bits of the int64 ids (12-20 ms of the 48-layer 16K prefill).
#: ``chunk``: slots per program (256 programs at 131,072); ``sub``: slots ranked at a time (a [sub, experts] one-hot);
#: ``scan_rows``: chunks (and row blocks) the scan takes at a time. On the H200 (docs/lab-notes.md 12): 341 -> 90 us
#: for one 131,072-slot alignment; the 16K prefill 553.4 -> 551.8 ms (one sample each).
ALIGN = {"chunked": True, "chunk": 512, "sub": 32, "scan_rows": 64}


def grouped_config(num_slots: int, num_experts: int, device: torch.device) -> dict | None:
    """`GROUPED` for a W4A4 call of ``num_slots`` (token, slot) pairs over ``num_experts`` experts, or None."""
    if not GROUPED or num_slots < GROUPED["from"] * max(num_experts, 1):
        return None
    if INTERPRETED or device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return None
    return GROUPED


def check_grouped_fp32(cfg: dict, hidden: int, width: int) -> bool:
    """Whether ``GROUPED["fp32"]``'s tiles divide the expert shapes (``hidden`` H, ``width`` I): the Triton grouped
    GEMMs load no masked tiles. Else the call takes the wgmma kernels."""
    t = cfg["fp32"]
    bk = t["block_k"]
    return not (hidden % bk or width % bk or width % t["block_n_gate_up"] or hidden % t["block_n_down"])


def check_wgmma_entry(cfg: dict, hidden: int, width: int) -> bool:
    """Whether a `WGMMA` entry's tiles divide the expert shapes (``hidden`` H, ``width`` I): else the other kernels
    run. A malformed entry (tiles the kernels cannot take) is a ValueError naming the fix."""
    bt, bk, nw = cfg["block_t"], cfg["block_k"], cfg["num_warps"]
    rows = 16 * nw
    choices = isinstance(cfg.get("maxnreg"), (tuple, list))
    caps = [*(cfg["maxnreg"] if choices else [cfg.get("maxnreg") or 0]), cfg.get("maxnreg_down") or 0]
    if bt % 8 or not 8 <= bt <= 256 or bk not in (128, 256) or nw not in (4, 8) or cfg["block_n_gate_up"] % rows \
            or cfg["block_n_down"] % rows or any(c and not 56 <= c <= 255 for c in caps) \
            or choices and not (cfg["maxnreg"] and all(caps)):  # fmt: skip
        raise ValueError(f"WGMMA entry {cfg}: block_t a multiple of 8 up to 256, block_k 128 or 256, num_warps 4 or 8, "
                         f"block_n_gate_up and block_n_down multiples of 16 * num_warps ({rows}), maxnreg and "
                         f"maxnreg_down 0 (none) or 56-255; a tuple of maxnreg caps needs maxnreg_down.")  # fmt: skip
    return not (hidden % bk or width % bk or width % cfg["block_n_gate_up"] or hidden % cfg["block_n_down"])


def hopper_config(num_slots: int, device: torch.device) -> dict | None:
    """The `HOPPER` entry for a W4A4 call on an sm_90+ GPU, or None (interpreter, older GPUs, empty table)."""
    if INTERPRETED or device.type != "cuda" or not HOPPER or torch.cuda.get_device_capability(device) < (9, 0):
        return None
    cfg = next((cfg for limit, cfg in HOPPER if num_slots <= limit), None)
    return cfg if cfg is not None and gluon_module("fp4_moe_hopper") is not None else None


def launch_config(num_slots: int, fp4_weights: bool = True) -> dict:
    if not fp4_weights:
        return CONFIG["dense"]
    for limit, cfg in CONFIG["by_slots"]:
        if num_slots <= limit:
            return cfg
    return CONFIG["by_slots"][-1][1]


def check_hopper_entry(cfg: dict) -> int:
    """The weight ring depth of a `HOPPER` entry (0: none), or a ValueError naming the fix."""
    stages = cfg.get("stages", 0)
    if stages and (stages < 2 or not cfg.get("x_shared")):
        raise ValueError(f"HOPPER entry {cfg}: set 'stages' to 0 (no ring) or >= 2, with 'x_shared': True.")
    early = cfg.get("early_weights", 0)
    if early not in (0, 1, 2) or early and (stages or cfg.get("x_shared")):
        raise ValueError(f"HOPPER entry {cfg}: 'early_weights' is 0, 1 or 2; it holds the weights in registers: "
                         "set 'x_shared': False and 'stages': 0 with it.")  # fmt: skip
    return stages


#: Batch 1's fused split-K sum, SiLU and hidden quantization (`fp4_moe_common.down_input`'s quantizing launch): whole rows per program
#: and values per thread (the warps follow). The kernel is one dependent chain per thread, so fewer values per thread
#: is a shorter chain: one row and 4 values (8 warps, 32 registers, 712 sm_90 instructions against 1,824 for 4 rows
#: and 16 values) made batch 1's step 4% faster on the H200 (docs/lab-notes.md 2h).
HIDDEN_LAUNCH = {"rows": 1, "values_per_thread": 4}
