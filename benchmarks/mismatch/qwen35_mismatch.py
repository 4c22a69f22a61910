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
model (attention, MoE, norms at another shape); and the fp32 model as a floor.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random

import torch


def warm(model, tok, steps: int, seed: int = 0):
    """Next-token training on lines like ``12+7=19``: a model whose predictions are peaked, not random."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss = torch.tensor(float("nan"))  # --warm-steps 0: the random model
    model.train()
    for _ in range(steps):
        lines = []
        for _ in range(16):
            a, b = rng.randrange(100), rng.randrange(100)
            lines.append(f"{a}+{b}={a + b}\n{b}+{a}={a + b}\n")
        batch = tok(lines, return_tensors="pt", padding=True).to(model.device)
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    return loss.item()


@contextlib.contextmanager
def capture(model):
    """Outputs of every layer's mixer, MoE block and whole layer, call by call."""
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        mixer = getattr(layer, "linear_attn", None) or layer.self_attn
        for name, mod in ((f"{i}.mixer", mixer), (f"{i}.moe", layer.mlp), (f"{i}.layer", layer)):

            def hook(m, a, out, name=name):
                seen.setdefault(name, []).append((out[0] if isinstance(out, tuple) else out).detach().float())

            hooks.append(mod.register_forward_hook(hook))
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def recurrent_training():
    """Training's Gated DeltaNet computed token by token, as the rollout's decode steps compute it."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as M

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


def measure(model, ids, mask, new: int, seed: int, recurrent: bool) -> dict:
    layer_types = model.config.layer_types
    P = ids.shape[1]
    torch.manual_seed(seed)
    with torch.no_grad(), capture(model) as roll:
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=new, min_new_tokens=new, return_dict_in_generate=True,
                             output_logits=True)  # fmt: skip
    seq = out.sequences
    comp = seq[:, P:]
    lp_roll = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, comp[..., None])[..., 0]
    full_mask = torch.cat([mask, torch.ones_like(comp)], 1)
    pos = (full_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad(), capture(model) as train, recurrent_training() if recurrent else contextlib.nullcontext():
        logits = model(input_ids=seq, attention_mask=full_mask, position_ids=pos).logits
    lp_train = logits[:, P - 1 : -1].float().log_softmax(-1).gather(-1, comp[..., None])[..., 0]
    d = lp_train - lp_roll
    res = {"mean_abs_logp_diff": d.abs().mean().item(), "max_abs_logp_diff": d.abs().max().item(),
           "kl_k3": (torch.expm1(-d) + d).mean().item(), "layers": []}  # fmt: skip
    for i, kind in enumerate(layer_types):
        row = {"index": i, "type": kind}
        for part in ("mixer", "moe", "layer"):
            steps = roll[f"{i}.{part}"][1:]  # decode calls: inputs are completion tokens 0 .. new-2
            a = torch.cat(steps, 1)
            b = train[f"{i}.{part}"][0][:, P : P + new - 1]
            row[part] = ((a - b).norm() / b.norm()).item()
        res["layers"].append(row)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--warm-steps", type=int, default=300)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    from trace_hf import testing as T

    tok = T.build_char_tokenizer()
    model = T.tiny_model("qwen3_5_moe_text", tokenizer=tok).to(dev)
    loss = warm(model, tok, args.warm_steps)
    rng = random.Random(1)
    prompts = [f"{rng.randrange(100)}+{rng.randrange(100)}=" + "\n" * rng.randrange(3) for _ in range(args.rows)]
    batch = tok(prompts, return_tensors="pt", padding=True).to(dev)
    results = {"args": vars(args), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               "torch": torch.__version__, "warm_loss": loss, "layer_types": model.config.layer_types}  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        m = model.to(dtype)
        name = str(dtype).split(".")[-1]
        for recurrent in (False, True):
            key = f"{name}_train_{'recurrent' if recurrent else 'chunked'}"
            results[key] = measure(m, batch.input_ids, batch.attention_mask, args.new, 0, recurrent)
            r = results[key]
            print(key, {k: round(v, 6) for k, v in r.items() if k != "layers"})
            for row in r["layers"]:
                print("   ", row["index"], row["type"], {k: f"{row[k]:.2e}" for k in ("mixer", "moe", "layer")})
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
