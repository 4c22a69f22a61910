# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""What an installed trace-hf (a wheel, a git URL) must do outside the clone: hold every module of the source tree,
load a model with TraceFP4Config and train one GRPO step on CPU.

    python .ci/installed_smoke.py SOURCE_ROOT [--imports-only]    # run from a directory outside the clone
"""

import importlib
import os
import sys
import tempfile


root = os.path.realpath(sys.argv[1])
import trace_hf  # noqa: E402


here = os.path.realpath(os.path.dirname(trace_hf.__file__))
assert not here.startswith(root + os.sep), f"trace_hf was imported from the clone ({here}), not the installed package"

# Every source module is in the install, under its installed name.
expected = {
    "trace_hf." + os.path.relpath(os.path.join(d, f), os.path.join(root, "trace_hf"))[:-3].replace(os.sep, ".")
    for d, _, files in os.walk(os.path.join(root, "trace_hf"))
    for f in files
    if f.endswith(".py")
}
expected |= {"trace_hf.kernels." + f[:-3] for f in os.listdir(os.path.join(root, "kernels")) if f.endswith(".py")}
expected = {m.removesuffix(".__init__") for m in expected}
for name in sorted(expected):
    module = importlib.import_module(name)
    assert os.path.realpath(module.__file__).startswith(here), f"{name} imported from {module.__file__}"
print(f"installed trace_hf at {here}: {len(expected)} modules import")
if "--imports-only" in sys.argv:
    sys.exit(0)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from trace_hf import TraceFP4Config, TraceGRPOConfig, TraceGRPOTrainer  # noqa: E402
from trace_hf.data import addition_dataset, arithmetic_reward, to_grpo_dataset  # noqa: E402
from trace_hf.quant.experts import fp4_experts  # noqa: E402
from trace_hf.testing import save_tiny_model  # noqa: E402


with tempfile.TemporaryDirectory() as tmp:
    model = AutoModelForCausalLM.from_pretrained(
        save_tiny_model(os.path.join(tmp, "tiny")), quantization_config=TraceFP4Config()
    )
    assert fp4_experts(model), "TraceFP4Config converted no experts"
    args = TraceGRPOConfig(
        output_dir=os.path.join(tmp, "out"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, use_cpu=True, activation_checkpointing=False, report_to="none",
    )  # fmt: skip
    trainer = TraceGRPOTrainer(
        model=model, reward_funcs=arithmetic_reward, args=args, train_dataset=to_grpo_dataset(addition_dataset())
    )
    before = next(p for p in model.parameters() if p.requires_grad).detach().clone()
    trainer.train()
    assert trainer.state.global_step == 1
    assert "trace/hint_flip_rate" in trainer.state.log_history[0], trainer.state.log_history[0]
    after = next(p for p in model.parameters() if p.requires_grad)
    assert not torch.equal(before, after), "the GRPO step changed no parameter"
print("installed trace_hf: TraceFP4Config load and one GRPO step on CPU")
