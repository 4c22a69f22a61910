#!/usr/bin/env bash
# Device call h200_89 (one H200), issue 31, at commit 0502f30 (branch int). OUT=$OUT bash gpu/call4.sh
# Device call h200_89 (issue 31), the session's final code: (1) the 1K decode table, both precisions in one run; (2)
# the 16K prefill with the chunked expert alignment off (fp4) and on (fp4_chunked_align) against BF16, and
# moe_align alone; (3) the GPU tests of everything this session touched, in the time left.
set -u
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/r; mkdir -p "$R"
timeout 110 python3 -m benchmarks.rollout.rollout_decode --setups fast_bf16,fast_fp4 --batches 1,64,128,256,512 \
  --contexts 1024 --steps 20 --out "$OUT/decode_1k.json" > "$R/decode_1k.log" 2>&1
echo "decode rc=$? at $((SECONDS - START)) s"; grep -E "^setup=" "$R/decode_1k.log" | cut -c1-110
timeout 30 python3 - <<'PY' 2>&1 | tee "$OUT/align.log"
import torch, triton
from trace_hf.kernels import moe_align as ma
ids = (torch.randn(16384, 128, device="cuda") + torch.linspace(0, 3, 128, device="cuda")).topk(8).indices
for backend in ("torch", "chunks"):
    ms = triton.testing.do_bench(lambda: ma.moe_align(ids, 128, 128, backend=backend), warmup=50, rep=200)
    print(f"moe_align 131072 slots, block_m 128, {backend}: {ms * 1e3:.1f} us")
PY
timeout 120 python3 -m benchmarks.rollout.prefill --setups fp4,fp4_chunked_align,bf16 --cells 1x16384 --budget-s 100 \
  --out "$OUT/prefill.json" > "$R/prefill.log" 2>&1
echo "prefill rc=$? at $((SECONDS - START)) s"; grep -E "^setup=|^ +1 x" "$R/prefill.log" | cut -c1-200
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
T=$PWD/tests
(cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout $((575 - (SECONDS - START))) python3 -m pytest -q -m gpu \
  -p no:cacheprovider --rootdir="$OLDPWD" "$T/kernels/test_fp4_moe_hopper.py" "$T/kernels/test_fp4_moe_wgmma.py" \
  "$T/kernels/test_fp4_attention_hopper.py" "$T/rollout/test_fast_decode.py" "$T/kernels/test_fp4_moe.py" \
  "$T/rollout/test_load_fp4_kv.py" "$T/kernels/test_fp4_kernels.py" "$T/hints/test_hint_sites.py") \
  > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? at $((SECONDS - START)) s"; grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | cut -c1-250 | tail -n 15
echo "total $((SECONDS - START)) s"
