# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`benchmarks.training.grpo_step`'s GRPO steps on a random Qwen3.5-35B-A3B-shaped model instead of Qwen3-30B-A3B.

    python -m benchmarks.training.grpo_step_qwen35 --prompt-len 128 --completion 512 --out outputs/grpo_step_qwen35.json
    python -m benchmarks.training.grpo_step_qwen35 --smoke --out /tmp/grpo_step_qwen35_smoke.json   # CPU, interpreter

The shape (``--layers`` of them, 8 by default): hidden 2048, 256 routed experts of width 512 top-8 plus a 512-wide
shared expert with its sigmoid gate, Gated DeltaNet layers 3 of every 4 (16 key / 32 value heads of 128, conv
kernel 4), gated full attention every 4th (16 query / 2 KV heads of 256, partial RoPE over 64), vocabulary
151,936. The setups, batch, timing and JSON are those of ``grpo_step`` (its options apply), whose ``main`` this
script calls with its own ``build_model``. Without flash-linear-attention / causal-conv1d, transformers' Qwen3.5 prefill and
training run its torch fallbacks; the engine's decode steps never use them.
"""

from __future__ import annotations

import sys

from benchmarks.training import grpo_step


def build_model(args, fp4: bool, dev, shape: dict | None = None):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig

    from trace_hf import TraceFP4Config
    from trace_hf.quant.quantizer import quantize_model

    if shape is not None:  # a caller's (launch_census --shape mid_qwen35)
        shape = dict(shape)
    elif args.smoke:
        shape = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                 "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "vocab_size": 300,
                 "shared_expert_intermediate_size": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                 "linear_key_head_dim": 16, "linear_value_head_dim": 16}  # fmt: skip
    else:
        shape = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                 "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512, "vocab_size": 151936,
                 "shared_expert_intermediate_size": 512, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                 "linear_key_head_dim": 128, "linear_value_head_dim": 128}  # fmt: skip
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.layers)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    cfg = Qwen3_5MoeTextConfig(num_hidden_layers=args.layers, layer_types=types, max_position_embeddings=32768,
                               tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                               linear_conv_kernel_dim=4, **shape)  # fmt: skip
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    opt_in = getattr(args, "prefill_bf16_gemms", False)
    if args.freeze_experts:  # no BF16 expert master: 40 layers of 256 experts would not fit beside the FP4 ones
        return grpo_step.build_frozen(cfg, fp4, dev, dtype, opt_in)
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if fp4:
        quantize_model(model, TraceFP4Config(prefill_bf16_gemms=opt_in))
    return model


if __name__ == "__main__":
    sys.exit(grpo_step.main(build_model=build_model))
