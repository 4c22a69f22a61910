# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""A two-step TraceGRPOTrainer run on two CPU processes (see test_trainer_distributed.py).

    torchrun --standalone --nproc_per_node 2 tests/distributed_grpo.py OUT_DIR

Each process rolls out its own rows with hints; TRL gathers rewards across processes and slices them back. The main
process writes the log history to OUT_DIR/log_history.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main(out_dir: str) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from trace_hf import TraceFP4Config, TraceGRPOConfig, TraceGRPOTrainer
    from trace_hf import testing as T

    torch.set_num_threads(1)
    # One copy per rank (the weights depend only on the seed): no process group exists yet to wait on.
    model_dir = T.save_tiny_model(os.path.join(out_dir, f"model-{os.environ.get('RANK', '0')}"))
    rows = [(a, b) for a in range(4) for b in range(4)]
    dataset = Dataset.from_dict(
        {"prompt": [T.format_prompt(f"{a}+{b}") for a, b in rows], "answer": [f"#### {a + b}" for a, b in rows]}
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
    )
    trainer = TraceGRPOTrainer(
        model, T.arithmetic_reward, args=args, train_dataset=dataset, processing_class=T.build_char_tokenizer()
    )
    trainer.train()
    if trainer.accelerator.is_main_process:
        with open(os.path.join(out_dir, "log_history.json"), "w") as f:
            json.dump({"num_processes": trainer.accelerator.num_processes, "history": trainer.state.log_history}, f)


if __name__ == "__main__":
    main(sys.argv[1])
