#!/usr/bin/env bash
# gemv (issue 31: batch-1 decode step FP4 >= 1.2x fast BF16; ~1.175x in h200_87): two `decode_ops.GEMV` keys for
# the one-row GEMVs of batch 1 (QKV, o_proj, router; both precisions), both off by default:
# ``early_tiles``: each program loads its first K tiles of weights before its PDL wait, so that a layer's weight
# stream overlaps the end of the kernel before it (add + RMSNorm, attention combine) and all of a program's weight
# loads are in flight at once (today: one K tile per round trip); ``x_bcast``: x read in the weights' layout, no
# shared-memory layout change (4 barriers after the wait instead of 10-14). Same FMAs in the same order: same bits.
# sm_90 (Triton 3.6): committed 56 registers; early 2: 48, early 4: 64; with x_bcast 50 and 64; every early weight
# load ahead of the griddepcontrol.wait, no spills.
# Run from the repository root on the H200; writes $OUT/gemv/gemv.log and $OUT/gemv/hopper_ab.json. ~150-250 s
# (tests ~40 s, microbench ~20 s, the A/B 4 rollout_decode runs).
#
# Expect: (1) GPU tests pass (test_fast_decode.py -k gemv: early_tiles 1, 2, 4 and x_bcast bit for bit against the
# committed launch at the Qwen3 shapes, eager and in graph replays after a PDL add + RMSNorm that writes x;
# batch-1 decode-step graph replays, FP4 and BF16, logits and tokens equal).
# (2) microbench: 8 layers' chain (add + RMSNorm, QKV gemv, o_proj gemv, add + RMSNorm, router gemv; 8 weight copies,
# 300 MB, so HBM) in a CUDA graph under PDL, us per layer by round for base, e2, e4, xb, e2xb, e4xb, every
# "outputs_equal" true; "best": the fastest non-base variant, which (3) A/Bs. The three products alone took 15.0 us
# a layer in gemv_tune (h200_41); a gain of ~5 us a layer here is ~250 us a step.
# (3) hopper_ab, fast_bf16 and fast_fp4 at batch 1, 1K: the best variant against base, two rounds. Keep (the lead
# sets those GEMV keys) if both precisions gain in both rounds by more than the rounds' spread (~0.3%); the 1.2x
# goal needs the step ~250-300 us shorter (the products are the same bytes in both precisions, so FP4's shorter
# step gains the larger fraction: FP4 / BF16 rises). If the microbench ranks e2 or xb alone near the best, A/B
# those next.
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
BEST=$(mktemp)
echo '{"e4": {"decode_ops.GEMV": {"early_tiles": 4}}}' > "$BEST"
timeout 100 $PY - "$BEST" <<'PYEOF' 2>&1 | tail -n 12 | tee -a "$LOG"
import json
import sys
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


variants = {"base": {}, "e2": {"early_tiles": 2}, "e4": {"early_tiles": 4}, "xb": {"x_bcast": True},
            "e2xb": {"early_tiles": 2, "x_bcast": True}, "e4xb": {"early_tiles": 4, "x_bcast": True}}
base = dict(D.GEMV)
graphs, outs = {}, {}
for name, patch in variants.items():
    D.GEMV.update(base, **patch)
    res.copy_(res0)
    outs[name] = chain()  # eager: compiles, and the outputs to compare
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        chain()
    graphs[name] = gr
D.GEMV.update(base)
res_us = {n: [] for n in graphs}
reps = 30
for _ in range(3):
    for n, gr in graphs.items():
        gr.replay()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            gr.replay()
        b.record()
        torch.cuda.synchronize()
        res_us[n].append(round(a.elapsed_time(b) * 1000 / (reps * L), 2))
same = {n: torch.equal(outs["base"], o) for n, o in outs.items()}
best = min((n for n in variants if n != "base" and same[n]), key=lambda n: min(res_us[n]), default="e4")
print(json.dumps({"us_per_layer_by_round": res_us, "outputs_equal": same, "best": best}))
with open(sys.argv[1], "w") as f:  # the variant the decode-step A/B runs
    json.dump({best: {"decode_ops.GEMV": variants[best]}}, f)
PYEOF
echo "microbench done at $((SECONDS - START)) s" | tee -a "$LOG"

echo "== hopper_ab: decode step, batch 1, 1K, base vs the microbench's best: $(cat "$BEST")" | tee -a "$LOG"
AB=$(mktemp -d)
OUT="$AB" AB_ARGS="--setups fast_bf16,fast_fp4 --batches 1 --contexts 1024 --steps 20 --budget-s 40" \
  VARIANTS="$(cat "$BEST")" timeout $((590 - (SECONDS - START))) $PY -m benchmarks.kernels.hopper_ab > "$AB/ab.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s" | tee -a "$LOG"
grep -iE "error|Traceback|skipped" "$AB/ab.log" | tail -n 5 | tee -a "$LOG"
if cp "$AB/hopper_ab.json" "$OUT/gemv/hopper_ab.json"; then
  $PY - "$OUT/gemv/hopper_ab.json" <<'PYEOF' 2>&1 | tee -a "$LOG"
import json, sys

res = json.load(open(sys.argv[1]))["tokens_per_s"]
for name, cells in res.items():
    print(name, cells)
names = sorted({k.rsplit(" ", 1)[0] for k in res} - {"base"})
for c in sorted({c for v in res.values() for c in v}):
    for v in names:
        rounds = [(res.get(f"base {r}", {}).get(c), res.get(f"{v} {r}", {}).get(c)) for r in (1, 2)]
        print(c, v, "over base by round", [f"{e / b - 1:+.2%}" if b and e else "n/a" for b, e in rounds])
for n in ["base"] + names:
    fp4 = [res.get(f"{n} {r}", {}).get("fast_fp4 b1 t1024") for r in (1, 2)]
    bf16 = [res.get(f"{n} {r}", {}).get("fast_bf16 b1 t1024") for r in (1, 2)]
    if all(fp4) and all(bf16):
        print(f"b1 {n}: FP4 / BF16 = {max(fp4) / max(bf16):.3f}x (best of 2 rounds)")
PYEOF
else
  tail -n 20 "$AB/ab.log" | tee -a "$LOG"
fi
echo "total $((SECONDS - START)) s" | tee -a "$LOG"
