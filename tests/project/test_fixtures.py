# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The offline fixtures every other test stands on: tokenizer, tiny models, data, reward, package layout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from trace_hf import data as D
from trace_hf import testing as T


PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLES = [
    "",
    "Q: Tom has 3 apples and buys 4 more. How many apples does he have?\nA:",
    T.ALPHABET,
    "  leading and trailing  \n\n",
    "#### -1,234.5",
    "<|im_start|>user\nhi<|im_end|>\n",
    "caf\u00e9 \u65e5\u672c \t\r\n \U0001f600",  # outside ALPHABET: still one token per UTF-8 byte
]


# ----------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return T.build_char_tokenizer()


def test_tokenizer_special_tokens_and_padding(tokenizer):
    assert tokenizer.padding_side == "left"
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == list(T.SPECIAL_TOKENS)
    assert (tokenizer.pad_token_id, tokenizer.unk_token_id) == (0, 1)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (2, 3)
    assert len(tokenizer) == len(T.SPECIAL_TOKENS) + 256
    # One token per character of the alphabet.
    for ch in T.ALPHABET:
        assert tokenizer(ch)["input_ids"] == [len(T.SPECIAL_TOKENS) + ord(ch)], repr(ch)
    batch = tokenizer(["Q: 1+1\nA:", "Q: 12+30\nA:"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, 0].item() == tokenizer.pad_token_id  # left padded
    assert batch["attention_mask"][0, 0].item() == 0 and batch["attention_mask"][:, -1].all()


@pytest.mark.parametrize("text", SAMPLES)
def test_tokenizer_decode_round_trip(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_tokenizer_chat_template(tokenizer):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and tokenizer.eos_token_id in ids


def _same_ids(a, b):
    for text in SAMPLES:
        assert a(text)["input_ids"] == b(text)["input_ids"], repr(text)
        ids = a(text)["input_ids"]
        assert b.decode(ids) == text
    assert a.padding_side == b.padding_side == "left"
    assert (a.pad_token_id, a.bos_token_id, a.eos_token_id) == (b.pad_token_id, b.bos_token_id, b.eos_token_id)
    assert a.chat_template == b.chat_template


def test_tokenizer_save_load_same_ids(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    path = T.save_char_tokenizer(tmp_path / "tok")
    _same_ids(tokenizer, AutoTokenizer.from_pretrained(path))


# ----------------------------------------------------------------------------------------------------------
# Data and reward
# ----------------------------------------------------------------------------------------------------------


def test_dataset_columns_and_determinism():
    ds = D.arithmetic_dataset(n_train=40, n_test=10, seed=3)
    assert set(ds) == {"train", "test"}
    assert ds["train"].column_names == ["question", "answer"] == ds["test"].column_names
    assert (ds["train"].num_rows, ds["test"].num_rows) == (40, 10)
    again = D.arithmetic_dataset(n_train=40, n_test=10, seed=3)
    assert ds["train"][:] == again["train"][:] and ds["test"][:] == again["test"][:]
    assert D.arithmetic_dataset(n_train=40, n_test=10, seed=4)["train"][:] != ds["train"][:]
    for row in ds["train"]:
        assert row["question"].endswith("?")
        assert "\n#### " in row["answer"]
        assert set(row["question"] + row["answer"]) <= set(T.ALPHABET)


def test_load_math_dataset_offline(tmp_path):
    assert D.load_math_dataset(None, "test", n_train=5, n_test=3)[:] == D.arithmetic_dataset(5, 3)["test"][:]
    both = D.load_math_dataset(D.OFFLINE_DATASET, None, n_train=5, n_test=3)
    assert set(both) == {"train", "test"}
    both.save_to_disk(str(tmp_path / "saved"))
    assert D.load_math_dataset(str(tmp_path / "saved"), "train")[:] == both["train"][:]


def test_grpo_dataset_has_plain_prompts():
    ds = D.to_grpo_dataset(D.arithmetic_dataset(n_train=6, n_test=2))
    row = ds["train"][0]
    assert isinstance(row["prompt"], str)
    assert row["prompt"] == D.format_prompt(row["question"])
    assert row["prompt"].startswith("Q: ") and row["prompt"].endswith("\nA:")
    assert "answer" in ds["train"].column_names


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so she has 72 clips.\n#### 72", "72"),
        ("#### 1,234", "1234"),
        ("The answer is -5.", "-5"),
        ("7 - 2 = 5", "5"),
        ("He pays $1,000,000.00 in total", "1000000"),
        ("12.50 dollars", "12.5"),
        ("first 3 then #### 8 and 9", "8"),
        ("#### -0", "0"),
        ("no number here", None),
        ("#### none", None),
    ],
)
def test_extract_final_number(text, expected):
    assert D.extract_final_number(text) == expected


def test_reward_scores_references_one_and_wrong_answers_zero():
    ds = D.arithmetic_dataset(n_train=64, n_test=0, seed=1)["train"]
    answers = ds["answer"]
    assert D.arithmetic_reward(answers, answers) == [1.0] * len(answers)
    wrong = [f"#### {int(D.extract_final_number(a)) + 1}" for a in answers]
    assert D.arithmetic_reward(wrong, answers) == [0.0] * len(answers)
    # Plain completions are scored by their last number; conversational ones by their content.
    ref = ["Tom has 3+4=<<3+4=7>>7 apples.\n#### 7"] * 4
    completions = [" 3+4=7. So 7", " I think 8", "", [{"role": "assistant", "content": "#### 7"}]]
    assert D.arithmetic_reward(completions, ref, prompts=["p"] * 4) == [1.0, 0.0, 0.0, 1.0]


# ----------------------------------------------------------------------------------------------------------
# Tiny models
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", T.FAMILIES)
def test_tiny_config_shape(family):
    cfg = T.tiny_config(family)
    assert cfg.model_type == family
    assert cfg.hidden_size == 64 and cfg.head_dim == 32 and cfg.moe_intermediate_size == 32
    assert cfg.num_hidden_layers >= 4 and cfg.num_experts >= 8 and cfg.num_experts_per_tok == 2
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.max_position_embeddings == 512 and not cfg.tie_word_embeddings and not cfg.output_router_logits
    assert cfg.vocab_size == len(T.build_char_tokenizer())
    if family == "qwen3_moe":
        assert cfg.decoder_sparse_step == 1 and cfg.mlp_only_layers == []
    else:
        assert {"linear_attention", "full_attention"} <= set(cfg.layer_types)
        assert cfg.shared_expert_intermediate_size == 32
        assert cfg.linear_key_head_dim % 16 == 0 and cfg.linear_value_head_dim % 16 == 0
        deeper = T.tiny_config(family, num_hidden_layers=8, full_attention_interval=4)
        assert deeper.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert T.tiny_config(family, num_hidden_layers=6).num_hidden_layers == 6


@pytest.mark.parametrize("family", T.FAMILIES)
def test_tiny_model_forward_generate_and_reload(family, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = T.tiny_model(family, tokenizer=tokenizer).eval()
    assert model.config.model_type == family
    layers = model.model.layers
    assert all(hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate") for layer in layers)
    assert tuple(layers[0].mlp.experts.gate_up_proj.shape) == (8, 64, 64)
    assert tuple(layers[0].mlp.experts.down_proj.shape) == (8, 64, 32)

    enc = tokenizer(["Q: 1+2\nA:", "Q: 10+20\nA:"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (2, enc["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 2 and enc["input_ids"].shape[1] < out.shape[1] <= enc["input_ids"].shape[1] + 4

    # Same seed, same weights; different seed, different weights.
    again = T.tiny_model(family, tokenizer=tokenizer)
    other = T.tiny_model(family, tokenizer=tokenizer, seed=1)
    name, p = next(iter(model.named_parameters()))
    assert torch.equal(p, again.get_parameter(name)) and not torch.equal(p, other.get_parameter(name))

    path = T.save_tiny_model(tmp_path / family, family, tokenizer=tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(**enc).logits, logits)
    _same_ids(tokenizer, AutoTokenizer.from_pretrained(path))
    assert loaded.generation_config.eos_token_id == tokenizer.eos_token_id
    assert loaded.generation_config.pad_token_id == tokenizer.pad_token_id


def test_tiny_model_bfloat16(tokenizer):
    model = T.tiny_model("qwen3_moe", tokenizer=tokenizer, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------------------
# Package layout
# ----------------------------------------------------------------------------------------------------------


def test_import_trace_hf():
    import trace_hf
    import trace_hf.fp4  # noqa: F401
    import trace_hf.testing  # noqa: F401

    assert callable(trace_hf.testing.tiny_model) and callable(trace_hf.fp4.quantize)


def _run_python(code: str, cwd) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_kernels_install_as_trace_hf_kernels(tmp_path):
    """kernels/ installs as trace_hf.kernels, and outside the repository no top-level `kernels` resolves into
    this project (that name belongs to the Hugging Face Kernels package, which transformers probes for)."""
    code = (
        "import importlib.util, os\n"
        "spec = importlib.util.find_spec('trace_hf.kernels.fp4_quant')\n"
        "print(os.path.realpath(spec.origin) if spec is not None else 'MISSING')\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(os.path.realpath(spec.origin) if spec is not None and spec.origin else 'NONE')\n"
    )
    kernel_module, top_level = _run_python(code, tmp_path).splitlines()
    assert kernel_module.endswith(os.path.join("kernels", "fp4_quant.py")), kernel_module
    assert not top_level.startswith(os.path.realpath(PROJECT_ROOT) + os.sep), top_level


def test_import_names_what_is_missing_without_kernels(tmp_path):
    """A copy of trace_hf/ with no kernels/ beside it (and none installed for it): the error says what is missing."""
    shutil.copytree(os.path.join(PROJECT_ROOT, "trace_hf"), tmp_path / "trace_hf")
    code = "try:\n    import trace_hf\nexcept ImportError as e:\n    print(e)\n"
    message = _run_python(code, tmp_path)
    assert "trace_hf.kernels" in message and "no kernels/ folder sits beside it" in message, message


def test_kernels_folder_is_ignored_by_transformers_from_the_repo_root():
    """From the repository root (cwd on sys.path, as with `python -c` or `python -m pytest`) kernels/ must stay a
    bare namespace folder: with an __init__.py transformers would import it as the Kernels package."""
    code = (
        "import importlib.metadata, importlib.util\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(repr(spec.origin) if spec is not None else 'None')\n"
        "try:\n"
        "    importlib.metadata.version('kernels')\n"
        "    print('hf-kernels-installed')\n"
        "except importlib.metadata.PackageNotFoundError:\n"
        "    from transformers.utils import import_utils\n"
        "    print(import_utils.is_kernels_available())\n"
    )
    origin, available = _run_python(code, PROJECT_ROOT).splitlines()
    assert not os.path.exists(os.path.join(PROJECT_ROOT, "kernels", "__init__.py"))
    assert origin in ("None", "''") or PROJECT_ROOT not in origin, origin
    if available != "hf-kernels-installed":
        assert available == "False"


# ----------------------------------------------------------------------------------------------------------
# The suite's collection on a GPU machine
# ----------------------------------------------------------------------------------------------------------


def test_a_gpu_machine_skips_cpu_cases_unless_interpreted(monkeypatch):
    """On a GPU machine without TRITON_INTERPRET=1 a test's cpu case (kernels interpreted) is skipped with the fix
    named, its cuda case and the other tests run; under TRITON_INTERPRET=1 nothing is skipped."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("root_conftest", os.path.join(PROJECT_ROOT, "tests", "conftest.py"))
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)

    class Item:
        def __init__(self, **params):
            self.callspec = type("CallSpec", (), {"params": params})() if params else None
            self.keywords, self.markers = {}, []

        def add_marker(self, mark):
            self.markers.append(mark)

    def collect(interpret: str | None):
        items = [Item(dev="cpu"), Item(device=torch.device("cpu")), Item(dev="cuda"), Item(dtype="cpu"), Item()]
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        if interpret is None:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        else:
            monkeypatch.setenv("TRITON_INTERPRET", interpret)
        conftest.pytest_collection_modifyitems(None, items)
        return [[m.kwargs["reason"] for m in item.markers] for item in items]

    skipped = collect(None)
    assert [bool(m) for m in skipped] == [True, True, False, False, False]
    assert "TRITON_INTERPRET=1" in skipped[0][0]
    assert collect("1") == [[], [], [], [], []]
