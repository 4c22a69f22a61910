#!/usr/bin/env bash
# b1fold: batch 1's split-K finish (sum of the 4 partials, SiLU * up, the hidden's NVFP4 quantization) folded into the
# Gluon gate/up launch (HOPPER entry key `fused_split`, off by default), which removes `_silu_mul_kernel` (5.95 us a
# layer, 13.3% of the FP4 step at batch 1, h200_92).
# (1) GPU tests of tests/kernels/test_fp4_moe_hopper.py (the new test_fused_split_gives_the_same_bits: y and the
#     quantized hidden bit for bit against `_silu_mul_kernel`'s path at 1-7 tokens, 128 and 16 experts) and the wgmma
#     fused-hidden test (`quantize_token_block` now writes its counter back to zero). Expect: all passed.
# (2) hopper_ab at batch 1, 1K context, fast_fp4: base, fold (fused_split) and fold_s2 (fused_split, split_k 2), two
#     rounds. Expect: fold above base by several percent (~4 us of ~52 us a layer), i.e. ~396 -> ~410+ tokens/s;
#     keep if both rounds gain >= 1%, drop if not.
# Writes $OUT/b1fold/gpu_tests.log and $OUT/b1fold/hopper_ab.json. ~2-3 minutes (the rest of the hopper tests
# last, in what is left of 200 s).
set -u -o pipefail
export PYTHONUNBUFFERED=1
START=$SECONDS
D="$OUT/b1fold"; mkdir -p "$D"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
T=$PWD/tests
gpu_tests() {  # pytest's GPU tests of the given selection, timeout $1 s, appended to the log
  local limit=$1; shift
  (cd "$PKG" && PYTHONPATH=$PKG:$PYTHONPATH timeout "$limit" python3 -m pytest -v -m gpu -p no:cacheprovider \
    --rootdir="$OLDPWD" "$@") 2>&1 | tee -a "$D/gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | cut -c1-200
  echo "tests rc=$? at $((SECONDS - START)) s" | tee -a "$D/gpu_tests.log"
}
# The fused paths first (the new test and what shares `quantize_token_block`), the rest of the file after the A/B.
gpu_tests 90 "$T/kernels/test_fp4_moe_hopper.py" "$T/kernels/test_fp4_moe_wgmma.py" -k "fused_split or fused_hidden"
AB=$(mktemp -d)
AB_ARGS="--setups fast_fp4 --batches 1 --contexts 1024 --steps 50 --budget-s 40" \
VARIANTS='{"fold": {"8": {"fused_split": true}}, "fold_s2": {"8": {"fused_split": true, "split_k": 2}}}' \
  OUT="$AB" timeout 90 python3 -m benchmarks.kernels.hopper_ab > "$AB/ab.log" 2>&1
echo "ab rc=$? at $((SECONDS - START)) s"
grep -iE "error|Traceback" "$AB/ab.log" | tail -n 5
cp "$AB/hopper_ab.json" "$D/" && python3 - "$D/hopper_ab.json" <<'PY'
import json, sys

res = json.load(open(sys.argv[1]))["tokens_per_s"]
for name, cells in res.items():
    print(name, {k: round(v, 1) for k, v in cells.items() if v})
cell = "fast_fp4 b1 t1024"
for n in ("fold", "fold_s2"):
    gains = [f"{res[f'{n} {r}'][cell] / res[f'base {r}'][cell] - 1:+.2%}" for r in (1, 2)
             if res.get(f"{n} {r}", {}).get(cell) and res.get(f"base {r}", {}).get(cell)]
    print(f"{cell}: {n} over base by round {gains}")
PY
LEFT=$((200 - (SECONDS - START))); gpu_tests $((LEFT > 40 ? LEFT : 40)) "$T/kernels/test_fp4_moe_hopper.py" -k "not fused_split and not fused_hidden"
echo "total $((SECONDS - START)) s"
