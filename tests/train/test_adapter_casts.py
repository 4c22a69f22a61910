# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""`disable_input_dtype_casting`: under autocast, PEFT's fp32 LoRA adapters fed their bf16 input uncast give the
loss and every gradient bit for bit, with fewer copies; adapters where the cast would change a value keep it; the
trainer applies it only where its forwards run under autocast, and one GRPO step is the same either way."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trace_hf import testing as T
from trace_hf.train.adapter_casts import autocast_adapter_inputs, uncastable_adapters


pytestmark = pytest.mark.usefixtures("one_thread")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _lora(model, **lora):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, **lora))
    for name, p in model.named_parameters():  # B starts at zero: give the adapters a gradient path through A
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(1))
    return model


@pytest.mark.parametrize(
    "family, device",
    [("qwen3_moe", "cpu"), ("qwen3_5_moe_text", "cpu"), pytest.param("qwen3_moe", "cuda", marks=pytest.mark.gpu)],
)
def test_uncast_inputs_keep_every_value_under_autocast(family, device):
    """On CUDA too: autocast's casts and cuBLAS see the same bf16 operands either way."""
    model = _lora(T.tiny_model(family, num_hidden_layers=4).to(torch.bfloat16)).to(device)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    adapters = uncastable_adapters(model)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}  # PEFT's default
    assert len(adapters) == sum(type(m).__name__ == "Linear" and hasattr(m, "lora_A") for m in model.modules()) > 0
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)).to(device)

    def run():
        model.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16), _Ops() as count:
            logits = model(input_ids=ids).logits
            logits.float().logsumexp(-1).sum().backward()
        return logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, count.ops

    want, want_grads, want_ops = run()
    with autocast_adapter_inputs(adapters):
        assert not any(m.cast_input_dtype_enabled for m in adapters)
        got, got_grads, got_ops = run()
    assert all(m.cast_input_dtype_enabled for m in adapters)  # restored
    assert torch.equal(got, want)
    assert want_grads.keys() == got_grads.keys() and all(torch.equal(got_grads[k], want_grads[k]) for k in want_grads)
    # Each adapter's forward, its checkpointed recompute and its backward each drop two [tokens, in] copies.
    assert want_ops["_to_copy"] - got_ops["_to_copy"] >= 2 * len(adapters)
    assert sum(want_ops.values()) > sum(got_ops.values())


def test_adapters_whose_cast_changes_values_keep_it():
    base = T.tiny_model("qwen3_moe", num_hidden_layers=2).to(torch.bfloat16)
    assert uncastable_adapters(_lora(base, lora_dropout=0.1)) == []  # dropout scales the fp32 copy
    assert uncastable_adapters(_lora(T.tiny_model("qwen3_moe", num_hidden_layers=2), use_dora=True)) == []
    half = _lora(T.tiny_model("qwen3_moe", num_hidden_layers=2).to(torch.bfloat16))
    for n, p in half.named_parameters():
        if "lora_" in n:
            p.data = p.data.half()  # bf16 -> fp16 would round
    assert uncastable_adapters(half) == []
    assert uncastable_adapters(T.tiny_model("qwen3_moe", num_hidden_layers=2)) == []  # no PEFT


def _trainer(tmp_path, bf16: bool, disable: bool):
    from datasets import Dataset
    from peft import LoraConfig

    from trace_hf.train import TraceGRPOConfig, TraceGRPOTrainer

    torch.manual_seed(0)
    model = T.tiny_model("qwen3_moe", num_hidden_layers=2).to(torch.bfloat16)
    args = TraceGRPOConfig(
        output_dir=str(tmp_path), rollout_precision="bf16", trace_hints=False, routing_replay=False,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=4, max_steps=1, learning_rate=1e-2,
        report_to="none", bf16=bf16, use_cpu=True, disable_tqdm=True, seed=0, save_strategy="no", logging_steps=1,
        disable_input_dtype_casting=disable,
    )  # fmt: skip
    data = Dataset.from_dict({"prompt": ["1+1=", "2+2=", "3+3=", "4+4="]})
    return TraceGRPOTrainer(
        model, reward_funcs=lambda completions, **k: [float(len(c)) for c in completions], args=args,
        train_dataset=data, processing_class=T.build_char_tokenizer(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS),
    )  # fmt: skip


def test_the_trainer_uncasts_only_under_autocast_and_trains_the_same(tmp_path):
    assert _trainer(tmp_path / "fp32", bf16=False, disable=True).uncast_adapters == []  # no autocast: keep PEFT's
    runs = {}
    for disable in (True, False):
        trainer = _trainer(tmp_path / str(disable), bf16=True, disable=disable)
        assert len(trainer.uncast_adapters) == (2 * len(TARGETS) if disable else 0)
        seen = []  # what the adapters' forwards saw: cast or not
        for m in trainer.model.modules():
            if hasattr(m, "lora_A") and hasattr(m, "cast_input_dtype_enabled"):
                m.register_forward_pre_hook(lambda mod, args: seen.append(mod.cast_input_dtype_enabled))
        trainer.train()
        assert seen and (False in seen) == disable  # the training-side forwards (generate's keep PEFT's cast)
        assert all(m.cast_input_dtype_enabled for m in trainer.uncast_adapters)  # restored after each forward
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
        runs[disable] = params, trainer.state.log_history[0]
    (p_on, log_on), (p_off, log_off) = runs[True], runs[False]
    assert p_on.keys() == p_off.keys() and all(torch.equal(p_on[k], p_off[k]) for k in p_on)
    assert log_on.keys() == log_off.keys()
    timings = ("time", "runtime", "second")
    assert all(log_on[k] == log_off[k] for k in log_on if not any(t in k for t in timings))
    assert log_on["trace/kl_rollout_train"] == log_off["trace/kl_rollout_train"]
