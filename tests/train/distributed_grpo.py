# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""A two-step TraceGRPOTrainer run on two CPU processes (see test_trainer_distributed.py).

    torchrun --standalone --nproc_per_node 2 tests/train/distributed_grpo.py OUT_DIR

Each rank then checks that the packed FP4 rollout weights its experts computed after the optimizer steps equal the
quantization of the updated masters. (FSDP through the Trainer is not tested here: accelerate enables FSDP only on
accelerators, never for MULTI_CPU; tests/train/distributed_fsdp2.py checks the model side with torch's `fully_shard`.)

Each process rolls out its own rows with hints; TRL gathers rewards across processes and slices them back. The main
process writes the log history to OUT_DIR/log_history.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def varied_reward(completions, **kwargs):
    """Differs within groups, so the random model gets a policy gradient and its weights move."""
    return [float(sum(map(ord, c)) % 7) / 7 for c in completions]


def main(out_dir: str) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from trace_hf import TraceFP4Config, TraceGRPOConfig, TraceGRPOTrainer
    from trace_hf import data as D
    from trace_hf import testing as T

    torch.set_num_threads(1)
    # One copy per rank (the weights depend only on the seed): no process group exists yet to wait on.
    model_dir = T.save_tiny_model(os.path.join(out_dir, f"model-{os.environ.get('RANK', '0')}"))
    rows = [(a, b) for a in range(4) for b in range(4)]
    dataset = Dataset.from_dict(
        {"prompt": [D.format_prompt(f"{a}+{b}") for a, b in rows], "answer": [f"#### {a + b}" for a, b in rows]}
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=TraceFP4Config())
    args = TraceGRPOConfig(
        output_dir=os.path.join(out_dir, "run"),
        per_device_train_batch_size=2,
        num_generations=4,  # 2 rows per process x 2 processes: each group spans both processes
        max_completion_length=6,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        use_cpu=True,
        dataloader_pin_memory=False,
        disable_tqdm=True,
        seed=0,
        learning_rate=1e-3,
    )
    trainer = TraceGRPOTrainer(
        model,
        [D.arithmetic_reward, varied_reward],
        args=args,
        train_dataset=dataset,
        processing_class=T.build_char_tokenizer(),
    )
    trainer.train()
    packed_ok = check_packed_weights(trainer)
    if trainer.accelerator.is_main_process:
        with open(os.path.join(out_dir, "log_history.json"), "w") as f:
            json.dump(
                {
                    "num_processes": trainer.accelerator.num_processes,
                    "packed_matches_full_masters": packed_ok,
                    "history": trainer.state.log_history,
                },
                f,
            )


def check_packed_weights(trainer) -> bool:
    """One more rollout-path forward, then compare every packed expert weight with its master's quantization."""
    from trace_hf import fp4
    from trace_hf.quant.experts import fp4_experts

    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7, 8]]))
    return all(
        torch.equal(
            m.weight_store.packed.weights[0].packed,
            fp4.quantize(m.gate_up_proj.detach(), m.fmt, scale="expert").packed,
        )
        for m in fp4_experts(model)
    )


if __name__ == "__main__":
    main(sys.argv[1])
