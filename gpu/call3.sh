#!/usr/bin/env bash
# Device call h200_88 (issue 31): batch 1's GEMV with early weight tiles (gpu/gemv.sh), the 128-row expert entry
# candidates (gpu/tune.sh), the 8K decode goal cells with this session's defaults (BF16 at its best batch 96, FP4 at
# 256 and 384), and the attention's spread decode at Qwen3.5's 256-wide heads (one call, on/off, same bits).
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/r; mkdir -p "$R"
timeout 190 bash gpu/gemv.sh > "$R/gemv_sh.log" 2>&1; echo "gemv rc=$? at $((SECONDS - START)) s"; tail -n 25 "$OUT/gemv/gemv.log" | cut -c1-300
timeout 170 bash gpu/tune.sh > "$R/tune_sh.log" 2>&1; echo "tune rc=$? at $((SECONDS - START)) s"; tail -n 25 "$OUT/tune/tune.log" | cut -c1-300
timeout 45 python3 -m benchmarks.rollout.rollout_decode --setups fast_bf16 --batches 96 --contexts 8192 --steps 10 \
  --out "$R/decode_8k_bf16.json" > "$R/decode_8k_bf16.log" 2>&1
timeout 60 python3 -m benchmarks.rollout.rollout_decode --setups fast_fp4 --batches 256,384 --contexts 8192 --steps 10 \
  --out "$R/decode_8k_fp4.json" > "$R/decode_8k_fp4.log" 2>&1
echo "8k at $((SECONDS - START)) s"; grep -hE "^setup=" "$R"/decode_8k_*.log | cut -c1-120
timeout 60 python3 - <<'PYEOF' 2>&1 | tee "$R/wide_heads.log"
import json
import torch
from trace_hf.kernels import fp4_attention as A

HQ, HKV, D = 16, 2, 256  # Qwen3.5-35B-A3B's full-attention layers
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
wide = A.CONFIG["hopper"]["wide_heads"]
for B, T, n in ((384, 8192, 1), (64, 32768, 1), (64, 1024, 8), (1, 32768, 16)):
    caches = []
    for _ in range(n):
        c = A.allocate_kv_cache(B, HKV, T, D, True, device=dev)
        A.fill_random(c, generator=g)
        caches.append(c)
    q = torch.randn(B, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    lengths = torch.full((B,), T, dtype=torch.int32, device=dev)
    graphs, res = {}, {}
    for name, on in (("base", False), ("spread", True)):
        wide["spread_decode"] = on
        for c in caches:
            A.decode_attention(q, c, lengths)
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            ys = [A.decode_attention(q, c, lengths) for c in caches]
        graphs[name], res[name] = gr, ys
    wide["spread_decode"] = False
    reps = max(3, 400 // (n * max(1, B * T // 65536)))
    times = {k: [] for k in graphs}
    for _ in range(3):
        for name, gr in graphs.items():
            gr.replay(); torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                gr.replay()
            b.record(); torch.cuda.synchronize()
            times[name].append(round(a.elapsed_time(b) * 1000 / (reps * n), 2))
    same = all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(res["base"], res["spread"]))
    print(f"{B}x{T}", json.dumps({"us_by_round": times, "spread_over_base": round(min(times["spread"]) / min(times["base"]), 4), "bits_equal": same}), flush=True)
    del caches, graphs, res
    torch.cuda.empty_cache()
PYEOF
echo "wide heads at $((SECONDS - START)) s"
cp "$R"/decode_8k_*.json "$R/wide_heads.log" "$OUT/" 2>/dev/null
echo "total $((SECONDS - START)) s"
