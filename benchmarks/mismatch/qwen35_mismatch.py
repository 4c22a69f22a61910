# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Where Qwen3.5's BF16 rollout/training mismatch sits, on a tiny warmed model (CPU, no FP4 anywhere).

    python -m benchmarks.mismatch.qwen35_mismatch --out docs/runs/qwen35_mismatch_cpu.json

The tiny Qwen3.5 MoE of `trace_hf.testing` (linear, full, linear, full attention; MoE + shared expert) is first
warmed by next-token training on arithmetic lines (fp32), then cast to BF16. The rollout is `model.generate`
(sampling at temperature 1; Gated DeltaNet stepped recurrently, conv by `causal_conv1d_update`, the torch
fallbacks); training is one teacher-forced forward over prompt + completion (the chunked Gated DeltaNet), with the
rollout's position ids. Reported: the mean |log p_train - log p_rollout| and the k3 KL estimate on the sampled
tokens (what `trace/kl_rollout_train` logs), and per decoder layer the relative L2 difference of the token
mixer's, the MoE block's and the layer's outputs at the decode positions. Then the same with training's chunked
Gated DeltaNet replaced by transformers' recurrent one (the rollout's numerics): what is left is the rest of the
model (attention, MoE, norms at another shape); and the fp32 model as a floor. Every layer row also gives each
block's own share (``mixer_local``, ``moe_local``): the block run in training's form on the rollout's own inputs,
against the rollout's outputs, so upstream differences do not count.

On CUDA (``--device cuda --shape small``: 8 layers, Gated DeltaNet at 3 of every 4, 128-wide heads as in the 35B-A3B
shape) it adds flash-linear-attention's kernels (``--fla``: its chunked rule for prefill and training, its fused
recurrent step for decode; recorded as not available, with the reason, when it does not import or its forward
fails) and the rollout engine against the training forward (``--engine``):

    python -m benchmarks.mismatch.qwen35_mismatch --device cuda --shape small --warm-steps 200 --warm-pairs 5 \
        --lr 1e-3 --new 96 --budget-s 80 --out mismatch.json

The torch rows always use transformers' torch fallbacks, also when fla is installed (transformers would pick fla);
the warm-up always does (fla's chunked backward refuses Triton < 3.7.1 on Hopper). fla's autotuners are pinned to
their first config by default (``--fla-autotune full`` times them all: minutes of compiling). Each row is written
to ``--out`` as soon as it is measured, and ``--budget-s`` skips the rows that would start later.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import random
import time

import torch


def warm(model, tok, steps: int, seed: int = 0, pairs: int = 1, lr: float = 3e-3):
    """Next-token training on lines like ``12+7=19`` (`pairs` line pairs a sample; more make sequences that span
    several of the chunked rule's 64-token chunks): a model whose predictions are peaked, not random."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = torch.tensor(float("nan"))  # --warm-steps 0: the random model
    model.train()
    for _ in range(steps):
        lines = []
        for _ in range(16):
            text = ""
            for _ in range(pairs):
                a, b = rng.randrange(100), rng.randrange(100)
                text += f"{a}+{b}={a + b}\n{b}+{a}={a + b}\n"
            lines.append(text)
        batch = tok(lines, return_tensors="pt", padding=True).to(model.device)
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    return loss.item()


@contextlib.contextmanager
def capture(model, inputs: bool = False):
    """Outputs of every layer's mixer, MoE block and whole layer, call by call; with `inputs`, also the mixer's and
    MoE block's hidden-state inputs and call arguments (under ``"<name>.in"`` and ``"<name>.kw"``)."""
    seen: dict[str, list] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        mixer = getattr(layer, "linear_attn", None) or layer.self_attn
        for name, mod in ((f"{i}.mixer", mixer), (f"{i}.moe", layer.mlp), (f"{i}.layer", layer)):

            def hook(m, args, kwargs, out, name=name):
                seen.setdefault(name, []).append((out[0] if isinstance(out, tuple) else out).detach().float())
                if inputs and not name.endswith(".layer"):
                    x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                    seen.setdefault(f"{name}.in", []).append(x.detach())
                    seen.setdefault(f"{name}.kw", []).append({k: v for k, v in kwargs.items() if k != "hidden_states"})

            hooks.append(mod.register_forward_hook(hook, with_kwargs=True))
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def _module():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as M

    return M


def torch_kernels() -> dict:
    """transformers' torch chunked and recurrent gated delta rule (behind its wrappers: transformers binds fla's in
    their place when fla imports)."""
    from trace_hf.train.delta_rule import torch_rules

    chunk, recurrent = torch_rules(_module())
    return {"chunk": chunk, "recurrent": recurrent}


def pin_fla_autotune() -> int:
    """Keep only the first config of every fla Triton autotuner: one compile a kernel instead of up to 48 (the
    device call's time), at the price of a tile shape that was not timed. Returns how many were pinned."""
    import sys

    from triton.runtime.autotuner import Autotuner

    n = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for obj in list(vars(mod).values()):
            for _ in range(4):  # Heuristics / fla's cache wrap the Autotuner
                if isinstance(obj, Autotuner) and len(obj.configs) > 1:
                    obj.configs = obj.configs[:1]
                    n += 1
                obj = getattr(obj, "fn", None)
                if obj is None:
                    break
    return n


def fla_kernels(device: torch.device, autotune: str, shape: dict) -> tuple[dict | None, dict]:
    """flash-linear-attention's chunked and fused recurrent gated delta rule, checked by one forward of each at the
    model's head shape; or None and why not (no crash: the measurement then records it)."""
    info: dict = {"available": False}
    if device.type != "cuda":
        info["reason"] = "needs CUDA (fla's Triton kernels do not run under the CPU interpreter)"
        return None, info
    try:
        import fla
        import triton
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as e:  # noqa: BLE001 - any import failure is the finding
        info["reason"] = f"flash-linear-attention does not import: {type(e).__name__}: {e}"
        return None, info
    info.update(version=getattr(fla, "__version__", "?"), triton=triton.__version__, autotune=autotune)
    if autotune == "first":
        info["pinned_autotuners"] = pin_fla_autotune()
    start = time.perf_counter()
    try:
        g = torch.Generator(device=device).manual_seed(0)
        B, T, H, HV, K, V = 2, 80, shape["H"], shape["HV"], shape["K"], shape["V"]
        q, k = (torch.randn(B, T, H, K, device=device, generator=g, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(B, T, HV, V, device=device, generator=g, dtype=torch.bfloat16)
        gate = -torch.rand(B, T, HV, device=device, generator=g)
        beta = torch.rand(B, T, HV, device=device, generator=g).to(torch.bfloat16)
        kw = {"g": gate, "beta": beta, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
        with torch.no_grad():
            o_c, _ = chunk_gated_delta_rule(q, k, v, **kw)
            o_r, _ = fused_recurrent_gated_delta_rule(q, k, v, **kw)
            ref, _ = torch_kernels()["recurrent"](q, k, v, **kw)
        torch.cuda.synchronize(device)
        rel = lambda a: ((a.float() - ref.float()).norm() / ref.float().norm()).item()  # noqa: E731
        info["probe_rel_err_vs_torch_recurrent"] = {"chunk": rel(o_c), "recurrent": rel(o_r)}
    except Exception as e:  # noqa: BLE001
        info["reason"] = f"fla's forward failed: {type(e).__name__}: {e}"
        return None, info
    info["probe_s"] = time.perf_counter() - start
    info["available"] = True
    return {"chunk": chunk_gated_delta_rule, "recurrent": fused_recurrent_gated_delta_rule}, info


def _as_transformers_calls(fn):
    """`fn` called as transformers calls its delta rules: keyword arguments it does not take are dropped."""
    params = set(inspect.signature(fn).parameters)

    def call(*args, **kwargs):
        return fn(*args, **{k: v for k, v in kwargs.items() if k in params})

    return call


@contextlib.contextmanager
def delta_rule(kernels: dict):
    """transformers' Qwen3.5 computing its gated delta rule with `kernels` (``{"chunk": f, "recurrent": g}``)."""
    M = _module()
    saved = M.torch_chunk_gated_delta_rule, M.torch_recurrent_gated_delta_rule
    M.torch_chunk_gated_delta_rule = _as_transformers_calls(kernels["chunk"])
    M.torch_recurrent_gated_delta_rule = _as_transformers_calls(kernels["recurrent"])
    try:
        yield
    finally:
        M.torch_chunk_gated_delta_rule, M.torch_recurrent_gated_delta_rule = saved


@contextlib.contextmanager
def recurrent_training():
    """Training's Gated DeltaNet computed token by token, as the rollout's decode steps compute it."""
    M = _module()
    chunk = M.torch_chunk_gated_delta_rule

    def as_recurrent(q, k, v, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, **kw):  # fmt: skip
        return M.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                  output_final_state=output_final_state,
                                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)  # fmt: skip

    M.torch_chunk_gated_delta_rule = as_recurrent
    try:
        yield
    finally:
        M.torch_chunk_gated_delta_rule = chunk


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _logp_stats(lp_train: torch.Tensor, lp_roll: torch.Tensor, keep: torch.Tensor | None = None) -> dict:
    d = lp_train - lp_roll
    if keep is not None:
        d = d[keep]
    return {"mean_abs_logp_diff": d.abs().mean().item(), "max_abs_logp_diff": d.abs().max().item(),
            "kl_k3": (torch.expm1(-d) + d).mean().item()}  # fmt: skip


def _local(model, roll: dict, train: dict, i: int, part: str, P: int, new: int) -> float:
    """Block `part` of layer `i` in training's form on the rollout's inputs (prefill, then each decode step's),
    against the rollout's outputs at the decode positions: the block's own rollout/training difference."""
    layer = model.model.layers[i]
    mod = layer.mlp if part == "moe" else getattr(layer, "linear_attn", None) or layer.self_attn
    x = torch.cat(roll[f"{i}.{part}.in"], 1)  # [B, P + new - 1, H]
    x = torch.cat([x, train[f"{i}.{part}.in"][0][:, -1:]], 1)  # the last input feeds no compared position
    from transformers import Cache

    kw = {k: (None if isinstance(v, Cache) else v) for k, v in train[f"{i}.{part}.kw"][0].items()}  # no cache writes
    out = mod(x, **kw) if part == "moe" else mod(hidden_states=x, **kw)
    out = out[0] if isinstance(out, tuple) else out
    return _rel(torch.cat(roll[f"{i}.{part}"][1:], 1), out[:, P : P + new - 1])


def measure(model, ids, mask, new: int, seed: int, recurrent: bool, rollout_kernels: dict | None = None,
            train_kernels: dict | None = None, local: bool = True) -> dict:  # fmt: skip
    """`generate` (with `rollout_kernels`) against one teacher-forced forward (with `train_kernels`, chunked or,
    with `recurrent`, token by token). Kernels default to transformers' torch fallbacks."""
    rollout_kernels = rollout_kernels or torch_kernels()
    train_kernels = train_kernels or torch_kernels()
    layer_types = model.config.layer_types
    P = ids.shape[1]
    torch.manual_seed(seed)
    with torch.no_grad(), delta_rule(rollout_kernels), capture(model, inputs=local) as roll:
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=new, min_new_tokens=new, return_dict_in_generate=True,
                             output_logits=True)  # fmt: skip
    seq = out.sequences
    comp = seq[:, P:]
    lp_roll = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, comp[..., None])[..., 0]
    full_mask = torch.cat([mask, torch.ones_like(comp)], 1)
    pos = (full_mask.cumsum(1) - 1).clamp(min=0)
    training = contextlib.ExitStack()
    training.enter_context(delta_rule(train_kernels))
    if recurrent:
        training.enter_context(recurrent_training())
    with torch.no_grad(), training:
        with capture(model, inputs=local) as train:
            logits = model(input_ids=seq, attention_mask=full_mask, position_ids=pos).logits
        lp_train = logits[:, P - 1 : -1].float().log_softmax(-1).gather(-1, comp[..., None])[..., 0]
        res = {**_logp_stats(lp_train, lp_roll), "layers": []}
        for i, kind in enumerate(layer_types):
            row = {"index": i, "type": kind}
            for part in ("mixer", "moe", "layer"):
                steps = roll[f"{i}.{part}"][1:]  # decode calls: inputs are completion tokens 0 .. new-2
                a = torch.cat(steps, 1)
                b = train[f"{i}.{part}"][0][:, P : P + new - 1]
                row[part] = _rel(a, b)
            if local:
                for part in ("mixer", "moe"):
                    row[f"{part}_local"] = _local(model, roll, train, i, part, P, new)
            res["layers"].append(row)
    return res


def measure_engine(model, ids, mask, new: int, seed: int, train: dict[str, dict]) -> dict:
    """`trace_hf.rollout.EngineRollout` (its own recurrent Gated DeltaNet step in a CUDA graph; prefill through the
    model with the torch fallbacks) against the teacher-forced forward with each of `train`'s kernels."""
    from transformers import GenerationConfig

    from trace_hf.rollout import EngineRollout

    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    g = model.generation_config
    gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                          eos_token_id=g.eos_token_id, pad_token_id=g.pad_token_id, bos_token_id=g.bos_token_id)  # fmt: skip
    torch.manual_seed(seed)
    start = time.perf_counter()
    with delta_rule(torch_kernels()):
        out = EngineRollout()(model, prompts, gc)
    res = {"rollout_s": time.perf_counter() - start, "tokens": out.num_tokens}
    n = max(len(c) for c in out.completion_ids)
    comp = torch.full((len(prompts), n), model.generation_config.pad_token_id, dtype=torch.long)
    keep = torch.zeros((len(prompts), n), dtype=torch.bool)
    lp_roll = torch.zeros((len(prompts), n))
    for r, (c, lp) in enumerate(zip(out.completion_ids, out.logprobs)):
        comp[r, : len(c)], keep[r, : len(c)], lp_roll[r, : len(c)] = torch.tensor(c), True, torch.tensor(lp)
    comp, keep, lp_roll = comp.to(ids.device), keep.to(ids.device), lp_roll.to(ids.device)
    P = ids.shape[1]
    seq = torch.cat([ids, comp], 1)
    full_mask = torch.cat([mask, keep.to(mask.dtype)], 1)
    pos = (full_mask.cumsum(1) - 1).clamp(min=0)
    for name, kernels in train.items():
        with torch.no_grad(), delta_rule(kernels):
            logits = model(input_ids=seq, attention_mask=full_mask, position_ids=pos).logits
        lp_train = logits[:, P - 1 : -1].float().log_softmax(-1).gather(-1, comp[..., None])[..., 0]
        res[f"train_{name}"] = _logp_stats(lp_train, lp_roll, keep)
    return res


#: ``--shape small``: the 35B-A3B layer pattern (Gated DeltaNet at 3 of every 4 layers) and head widths (128), small
#: elsewhere, so the delta rule's state and chunks have the real model's shape.
SMALL = {"hidden_size": 512, "num_hidden_layers": 8, "full_attention_interval": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 128, "num_experts": 32, "num_experts_per_tok": 4,
         "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256, "linear_key_head_dim": 128,
         "linear_value_head_dim": 128, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
         "max_position_embeddings": 1024}  # fmt: skip


def _print(key: str, r: dict) -> None:
    print(key, {k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items() if k != "layers"})
    for row in r.get("layers", []):
        parts = [k for k in ("mixer", "moe", "layer", "mixer_local", "moe_local") if k in row]
        print("   ", row["index"], row["type"], {k: f"{row[k]:.2e}" for k in parts})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--warm-steps", type=int, default=300)
    p.add_argument("--warm-pairs", type=int, default=1, help="line pairs per warm-up sample (1: ~28 tokens)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", choices=("tiny", "small"), default="tiny",
                   help="tiny: trace_hf.testing's 4-layer model; small: see SMALL")  # fmt: skip
    p.add_argument("--fla", action=argparse.BooleanOptionalAction, default=None,
                   help="also measure with flash-linear-attention's kernels (default: on CUDA)")  # fmt: skip
    p.add_argument("--fla-autotune", choices=("first", "full"), default="first",
                   help="first: pin fla's autotuners to their first config (compile time); full: autotune")  # fmt: skip
    p.add_argument("--engine", action=argparse.BooleanOptionalAction, default=None,
                   help="also measure trace_hf's rollout engine in BF16 (default: on CUDA)")  # fmt: skip
    p.add_argument("--fp32", action=argparse.BooleanOptionalAction, default=True, help="the fp32 floor rows")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="skip the rows that would start past this many seconds (0: no limit)")  # fmt: skip
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    on_cuda = dev.type == "cuda"
    use_fla = on_cuda if args.fla is None else args.fla
    use_engine = on_cuda if args.engine is None else args.engine
    from trace_hf import testing as T

    t0 = time.perf_counter()
    seconds: dict[str, float] = {}
    tok = T.build_char_tokenizer()
    model = T.tiny_model("qwen3_5_moe_text", tokenizer=tok, **(SMALL if args.shape == "small" else {})).to(dev)
    with delta_rule(torch_kernels()):  # fla's backward refuses Triton < 3.7.1 on Hopper
        loss = warm(model, tok, args.warm_steps, pairs=args.warm_pairs, lr=args.lr)
    seconds["warm"] = time.perf_counter() - t0
    rng = random.Random(1)
    prompts = [f"{rng.randrange(100)}+{rng.randrange(100)}=" + "\n" * rng.randrange(3) for _ in range(args.rows)]
    batch = tok(prompts, return_tensors="pt", padding=True).to(dev)
    results = {"args": vars(args), "device": torch.cuda.get_device_name(dev) if on_cuda else "cpu",
               "torch": torch.__version__, "warm_loss": loss, "layer_types": model.config.layer_types}  # fmt: skip
    import transformers

    results["transformers"] = transformers.__version__
    results["warm_precision"] = "float32 (AdamW), then cast"
    fla = None
    if use_fla:
        cfg = model.config
        shape = {"H": cfg.linear_num_key_heads, "HV": cfg.linear_num_value_heads, "K": cfg.linear_key_head_dim,
                 "V": cfg.linear_value_head_dim}  # fmt: skip
        fla, results["fla"] = fla_kernels(dev, args.fla_autotune, shape)
        print("fla:", results["fla"])
    ids, mask = batch.input_ids, batch.attention_mask
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def part(key: str, fn) -> None:
        """One row: timed, written out at once (a run cut short keeps its rows), an error recorded, not fatal."""
        if args.budget_s and time.perf_counter() - t0 > args.budget_s:
            results[key] = {"skipped": f"past --budget-s {args.budget_s}"}
        else:
            t = time.perf_counter()
            try:
                results[key] = fn()
            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                results[key] = {"error": f"{type(e).__name__}: {e}"}
            seconds[key] = time.perf_counter() - t
        _print(key, results[key])
        seconds["total"] = time.perf_counter() - t0
        results["seconds"] = seconds
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    for dtype in (torch.float32, torch.bfloat16) if args.fp32 else (torch.bfloat16,):
        m = model.to(dtype)
        name = str(dtype).split(".")[-1]
        for recurrent in (False, True):
            key = f"{name}_train_{'recurrent' if recurrent else 'chunked'}"
            part(key, lambda m=m, recurrent=recurrent: measure(m, ids, mask, args.new, 0, recurrent))
    model = model.to(torch.bfloat16)
    if fla is not None:
        # fla everywhere (what transformers runs with fla installed), its recurrent control, and each side alone.
        for key, roll_k, train_k, recurrent in (("bfloat16_fla_train_chunked", fla, fla, False),
                                               ("bfloat16_fla_train_recurrent", fla, fla, True),
                                               ("bfloat16_fla_rollout_torch_train", fla, None, False),
                                               ("bfloat16_torch_rollout_fla_train", None, fla, False)):  # fmt: skip
            part(key, lambda r=roll_k, t=train_k, rec=recurrent: measure(model, ids, mask, args.new, 0, rec, r, t))
    if use_engine:
        train = {"torch_chunked": torch_kernels(), **({"fla_chunked": fla} if fla is not None else {})}
        part("bfloat16_engine", lambda: measure_engine(model, ids, mask, args.new, 0, train))
    print("seconds", {k: round(v, 1) for k, v in seconds.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
