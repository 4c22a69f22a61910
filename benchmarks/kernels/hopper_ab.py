# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Decode throughput under variants of the decode kernels' launch settings (the Gluon experts' table
`fp4_moe_configs.HOPPER`, or any settings dict of a `trace_hf.kernels` module), in one process: each variant in turn, twice
(the repeat shows the spread), each a `benchmarks.rollout.rollout_decode` run with the arguments in AB_ARGS.

    AB_ARGS="--setups fast_fp4 --batches 1,64 --contexts 1024" \\
    VARIANTS='{"xs": {"*": {"x_shared": true}}, "bk128": {"1024": {"block_k": 128}},
               "tp": {"fp4_attention.CONFIG": {"hopper": {"target_programs": 1584}}}}' \\
    OUT=outputs/ab python -m benchmarks.kernels.hopper_ab

VARIANTS maps a name to a patch: ``{limit: {key: value}}`` updates the `HOPPER` entry of that slot limit, ``"*"``
every entry; ``{"WGMMA<from>": {key: value}}`` the `WGMMA` entry that starts at ``from`` slots per expert,
``"WGMMA*"`` every one, and ``{"WGMMA": [[from, cfg], ...]}`` replaces the whole table (to move where the wgmma kernels
start); ``{"module.NAME": {key: value}}`` merges into the dict ``trace_hf.kernels.module.NAME`` (nested dicts
key by key), e.g. ``fp4_moe_configs.HIDDEN_LAUNCH``, ``fp4_quant.CONFIG``, ``decode_ops.GEMV``. A variant ``base``
(the settings as committed) always runs first. Writes $OUT/hopper_ab.json: tokens/s per variant, round and cell.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import sys

from benchmarks.rollout import rollout_decode
from trace_hf.kernels import fp4_moe_configs


def patched(table: list, patch: dict) -> list:
    """`HOPPER` with ``patch``'s slot-limit keys applied; an unknown limit is an error, not a no-op."""
    limits = {str(lim) for lim, _ in table}
    unknown = {k for k in patch if "." not in k and not k.startswith("WGMMA")} - limits - {"*"}
    if unknown:
        raise SystemExit(f"VARIANTS names slot limits {sorted(unknown)}; HOPPER has {sorted(limits)} (or use '*').")
    return [(lim, {**cfg, **patch.get("*", {}), **patch.get(str(lim), {})}) for lim, cfg in table]


def patched_wgmma(table: list, patch: dict) -> list:
    """`WGMMA` with ``patch``'s ``WGMMA<from>`` / ``WGMMA*`` keys applied, or replaced by its ``WGMMA`` list; an
    unknown start is an error."""
    if "WGMMA" in patch:
        return [(start, dict(cfg)) for start, cfg in patch["WGMMA"]]
    starts = {f"WGMMA{start}" for start, _ in table}
    unknown = {k for k in patch if k.startswith("WGMMA")} - starts - {"WGMMA*", "WGMMA"}
    if unknown:
        raise SystemExit(f"VARIANTS names WGMMA entries {sorted(unknown)}; WGMMA has {sorted(starts)}.")
    return [(st, {**cfg, **patch.get("WGMMA*", {}), **patch.get(f"WGMMA{st}", {})}) for st, cfg in table]


def merged(settings: dict, patch: dict) -> dict:
    """``settings`` with ``patch`` merged in (nested dicts key by key); an unknown key is an error."""
    unknown = set(patch) - set(settings)
    if unknown:
        raise SystemExit(f"VARIANTS sets {sorted(unknown)}, which the settings {sorted(settings)} do not have.")
    return {
        k: merged(v, patch[k]) if isinstance(v, dict) and k in patch else patch.get(k, v) for k, v in settings.items()
    }


def settings_dicts(variants: dict) -> dict:
    """(module, attribute name) -> a copy of each settings dict that some variant patches."""
    out = {}
    for patch in variants.values():
        for key in (k for k in patch if "." in k):
            mod_name, attr = key.rsplit(".", 1)
            mod = importlib.import_module(f"trace_hf.kernels.{mod_name}")
            if not isinstance(getattr(mod, attr, None), dict):
                raise SystemExit(f"VARIANTS key {key!r}: trace_hf.kernels.{mod_name} has no settings dict {attr}.")
            out[key] = (mod, attr, copy.deepcopy(getattr(mod, attr)))
    return out


def apply(dicts: dict, patch: dict) -> None:
    for key, (mod, attr, base) in dicts.items():
        current = getattr(mod, attr)
        current.clear()
        current.update(merged(base, patch.get(key, {})))  # in place: kernels hold the module's dict


def main() -> int:
    out = os.environ["OUT"]
    variants = {"base": {}, **json.loads(os.environ.get("VARIANTS", "{}"))}
    base, dicts = list(fp4_moe_configs.HOPPER), settings_dicts(variants)
    wg_base = list(fp4_moe_configs.WGMMA)
    res = {}
    for rnd in (1, 2):
        for name, patch in variants.items():
            fp4_moe_configs.HOPPER[:] = patched(base, patch)
            fp4_moe_configs.WGMMA[:] = patched_wgmma(wg_base, patch)
            apply(dicts, patch)
            path = f"{out}/ab_{name}_{rnd}.json"
            rollout_decode.main(["--out", path, "--steps", "20"] + os.environ["AB_ARGS"].split())
            with open(path) as f:
                cells = json.load(f)["cells"]
            res[f"{name} {rnd}"] = {
                f"{c['setup']} b{c['batch']} t{c['context']}": c.get("tokens_per_s") for c in cells
            }
            print(name, rnd, fp4_moe_configs.HOPPER, fp4_moe_configs.WGMMA, res[f"{name} {rnd}"], flush=True)
    fp4_moe_configs.HOPPER[:] = base
    fp4_moe_configs.WGMMA[:] = wg_base
    apply(dicts, {})
    with open(f"{out}/hopper_ab.json", "w") as f:
        json.dump({"variants": variants, "tokens_per_s": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
