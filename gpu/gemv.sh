#!/usr/bin/env bash
# gemv (issue 31: batch-1 decode step FP4 >= 1.2x fast BF16; ~1.175x in h200_87): `decode_ops.GEMV` key
# ``early_tiles`` (default 0, off): each one-row GEMV program (QKV, o_proj, router) loads its first K tiles of
# weights before its PDL wait, so that a layer's weight stream overlaps the end of the kernel before it (add +
# RMSNorm, attention combine) and all of a program's weight loads are in flight at once (today: one K tile per
# round trip). Same FMAs in the same order: same bits. sm_90 (Triton 3.6): 2 tiles 48 registers, 4 tiles 64 (base
# 59), every early weight load ahead of the griddepcontrol.wait, no spills.
# Run from the repository root on the H200; writes $OUT/gemv/gemv.log and $OUT/gemv/hopper_ab.json. ~100-200 s.
#
# Expect: (1) GPU tests pass (test_fast_decode.py -k gemv: early_tiles 1, 2, 4 bit for bit against 0 at the Qwen3
# shapes, eager and in graph replays after a PDL add + RMSNorm that writes x; batch-1 decode-step graph replays,
# FP4 and BF16, logits and tokens equal).
# (2) microbench: 8 layers' chain (add + RMSNorm, QKV gemv, o_proj gemv, add + RMSNorm, router gemv; 8 weight copies,
# 300 MB, so HBM) in a CUDA graph under PDL, us per layer by round for early_tiles 0, 2, 4, and "outputs_equal":
# true. Base ~17-19 us a layer (gemv_tune: 15.0 us for the three products alone); early 4 should save ~2-5 us.
# (3) hopper_ab, fast_bf16 and fast_fp4 at batch 1, 1K: "early4" (GEMV early_tiles 4) against base, two rounds.
# Keep (the lead sets GEMV["early_tiles"] = 4, or 2 if the microbench has it ahead) if both precisions gain in both
# rounds by more than the rounds' spread (~0.3%); the goal needs the step ~250-300 us shorter (~+8-10% tokens/s in
# BF16, more in FP4 relative to BF16 only if FP4 gains more: the products are the same bytes in both, so FP4's
# shorter step gains the larger fraction).
set -u -o pipefail
ROOT=$(pwd)
OUT=${OUT:-outputs/h200}
mkdir -p "$OUT/gemv"
LOG="$OUT/gemv/gemv.log"
PKG=$(mktemp -d)
cp -r "$ROOT/trace_hf" "$PKG/trace_hf"
rm -rf "$PKG/trace_hf/kernels"
ln -s "$ROOT/kernels" "$PKG/trace_hf/kernels"
export PYTHONPATH="$PKG:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
START=$SECONDS
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
  $PY -c "import torch, triton; print(torch.__version__, triton.__version__)"
  git -C "$ROOT" log -1 --format=%h 2>/dev/null
} 2>&1 | tee "$LOG"

echo "== GPU tests" | tee -a "$LOG"
(cd "$PKG" && timeout 120 $PY -m pytest -q -m gpu -p no:cacheprovider --rootdir="$ROOT" -k gemv \
  "$ROOT/tests/rollout/test_fast_decode.py" 2>&1) | tail -n 15 | tee -a "$LOG"
echo "tests done at $((SECONDS - START)) s" | tee -a "$LOG"

echo "== microbench: 8 layers' one-row products and norms under PDL, graph, by early_tiles" | tee -a "$LOG"
timeout 90 $PY - <<'PYEOF' 2>&1 | tail -n 12 | tee -a "$LOG"
import json
import torch
from trace_hf.kernels import decode_ops as D

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
H, QKV, O, E, L = 2048, 5120, 4096, 128, 8


def rnd(*shape):
    return torch.randn(*shape, device=dev, generator=g).mul_(0.02).bfloat16()


layers = [(rnd(QKV, H), rnd(H, O), rnd(E, H)) for _ in range(L)]  # 8 copies: 300 MB, past the 50 MB L2
ln = torch.ones(H, device=dev, dtype=torch.bfloat16)
res0 = torch.randn(1, H, device=dev, generator=g).bfloat16()
res = res0.clone()


def chain():
    outs = []
    for wq, wo, wr in layers:
        qkv = D.gemv(D.add_rmsnorm(res, None, ln, 1e-6), wq)
        o = D.gemv(qkv[:, :O], wo)
        outs.append(D.gemv(D.add_rmsnorm(res, o.unsqueeze(1), ln, 1e-6), wr))
    return torch.cat(outs)


graphs, outs = {}, {}
for early in (0, 2, 4):
    D.GEMV["early_tiles"] = early
    res.copy_(res0)
    outs[early] = chain()  # eager: compiles, and the outputs to compare
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        chain()
    graphs[early] = gr
D.GEMV["early_tiles"] = 0
res_us = {e: [] for e in graphs}
reps = 30
for _ in range(3):
    for e, gr in graphs.items():
        gr.replay()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            gr.replay()
        b.record()
        torch.cuda.synchronize()
        res_us[e].append(round(a.elapsed_time(b) * 1000 / (reps * L), 2))
same = all(torch.equal(outs[0], o) for o in outs.values())
print(json.dumps({"us_per_layer_by_round": res_us, "outputs_equal": same}))
PYEOF
echo "microbench done at $((SECONDS - START)) s" | tee -a "$LOG"

echo "== hopper_ab: decode step, batch 1, 1K, base vs GEMV early_tiles 4" | tee -a "$LOG"
AB=$(mktemp -d)
OUT="$AB" AB_ARGS="--setups fast_bf16,fast_fp4 --batches 1 --contexts 1024 --steps 20 --budget-s 40" \
  VARIANTS='{"early4": {"decode_ops.GEMV": {"early_tiles": 4}}}' \
  timeout $((590 - (SECONDS - START))) $PY -m benchmarks.kernels.hopper_ab > "$AB/ab.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s" | tee -a "$LOG"
grep -iE "error|Traceback|skipped" "$AB/ab.log" | tail -n 5 | tee -a "$LOG"
if cp "$AB/hopper_ab.json" "$OUT/gemv/hopper_ab.json"; then
  $PY - "$OUT/gemv/hopper_ab.json" <<'PYEOF' 2>&1 | tee -a "$LOG"
import json, sys

res = json.load(open(sys.argv[1]))["tokens_per_s"]
for name, cells in res.items():
    print(name, cells)
for c in sorted({c for v in res.values() for c in v}):
    rounds = [(res.get(f"base {r}", {}).get(c), res.get(f"early4 {r}", {}).get(c)) for r in (1, 2)]
    print(c, "early4 over base by round", [f"{e / b - 1:+.2%}" if b and e else "n/a" for b, e in rounds])
for n in ("base", "early4"):
    fp4 = [res.get(f"{n} {r}", {}).get("fast_fp4 b1 t1024") for r in (1, 2)]
    bf16 = [res.get(f"{n} {r}", {}).get("fast_bf16 b1 t1024") for r in (1, 2)]
    if all(fp4) and all(bf16):
        print(f"b1 {n}: FP4 / BF16 = {max(fp4) / max(bf16):.3f}x (best of 2 rounds)")
PYEOF
else
  tail -n 20 "$AB/ab.log" | tee -a "$LOG"
fi
echo "total $((SECONDS - START)) s" | tee -a "$LOG"
