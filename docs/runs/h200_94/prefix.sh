#!/usr/bin/env bash
# Shared prefill (branch prefix): the engine prefills each distinct prompt of a wave once (share_prefill=True, the new
# default) and gives its K/V cache, first-token logits and prompt hints to every row with that prompt.
# Expects the lead's preamble (trl, datasets importable; PYTHONPATH as for the other device calls).
# (1) GPU tests: load_fp4_kv with repeated source rows (bits against the torch gathers), the decode step's tests, and
#     the engine with 16 prompts x 4 generations shared vs not (prefill_rows 16 vs 64, rows agree but for bf16
#     near-ties). Expect all passed.
# (2) One GRPO step benchmark with sharing on (8 layers, 32 prompts x 8 generations = 256 rows, 512 completion tokens,
#     mean 192). Compare with h200_92 (no sharing): FP4 rollout 47,563 tok/s with rollout_prefill 0.137 s; BF16
#     36,051 tok/s, prefill 0.138 s. Expect engine_last_rollout.prefill_rows = 32 (not 256) and rollout_prefill in
#     phases_last_step well under 0.137 / 0.138 s (the prefill of 32 rows instead of 256; the cache load still writes
#     256 rows), so rollout tok/s up by roughly that time over the 1.41 / 1.86 s rollouts (~+5-8%). Keep the default
#     on if both rollouts are faster and nothing else moved; the tests decide correctness.
# About 150-180 s of GPU time (tests ~40 s, the two setups ~70 s each).
set -u -o pipefail
export PYTHONUNBUFFERED=1
START=$SECONDS
mkdir -p "$OUT/prefix"
PKG=$(mktemp -d); cp -r trace_hf "$PKG/"; rm -rf "$PKG/trace_hf/kernels"; ln -s "$PWD/kernels" "$PKG/trace_hf/kernels"
T=$PWD/tests
(cd "$PKG" && PYTHONPATH=$PKG:${PYTHONPATH:-} timeout 200 python3 -m pytest -q -s -m gpu -p no:cacheprovider \
  --rootdir="$OLDPWD" "$T/rollout/test_load_fp4_kv.py" "$T/rollout/test_engine_shared_prefill.py" \
  "$T/rollout/test_fast_decode.py") > "$OUT/prefix/gpu_tests.log" 2>&1
echo "tests rc=$? at $((SECONDS - START)) s"
grep -E "shared prefill|passed|failed|FAILED|ERROR" "$OUT/prefix/gpu_tests.log" | cut -c1-250 | tail -n 15
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
timeout 330 python3 -m benchmarks.training.grpo_step --prompts 32 --completion 512 --eos-mean 192 \
  --setups engine_bf16,engine_fp4 --steps 3 --out "$OUT/prefix/grpo_step.json" > /tmp/grpo_step.log 2>&1
echo "grpo_step rc=$? at $((SECONDS - START)) s"; tail -n 5 /tmp/grpo_step.log | cut -c1-300
python3 - "$OUT/prefix/grpo_step.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    if "error" in r:
        print(r["setup"], r["error"]); continue
    st, ph = r["engine_last_rollout"] or {}, r["phases_last_step"] or {}
    print(f"{r['setup']}: rollout {r['rollout_tokens_per_s']:,.0f} tok/s, {r['rollout_s']:.3f} s (last "
          f"{r['rollout_s_last']:.3f}); rollout_prefill {ph.get('rollout_prefill')}; prefill_rows "
          f"{st.get('prefill_rows')} of {st.get('rows')}; step {r['step_s']:.2f} s; peak {r['peak_gib']:.1f} GiB")
PY
echo "total $((SECONDS - START)) s"
