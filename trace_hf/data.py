# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""Math tasks for GRPO: GSM8K-shaped data sets (offline arithmetic or the Hub's), prompts, and the reward.

What a training script imports to build a data set and score completions; it needs no model. The offline problems
exist because no machine this project runs on reaches the Hugging Face Hub: they have GSM8K's ``question`` /
``answer`` columns, so ``openai/gsm8k`` drops in wherever the Hub is reachable.
"""

from __future__ import annotations

import os
import random
import re
from decimal import Decimal, InvalidOperation
from typing import Any


__all__ = [
    "OFFLINE_DATASET",
    "addition_dataset",
    "arithmetic_dataset",
    "chain_dataset",
    "carry_dataset",
    "carry_worked_answer",
    "load_math_dataset",
    "format_prompt",
    "to_grpo_dataset",
    "extract_final_number",
    "arithmetic_reward",
    "exact_answer_reward",
]

# ----------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------

#: The name `load_math_dataset` maps to the offline arithmetic problems.
OFFLINE_DATASET = "offline-arithmetic"

_NAMES = (("Tom", "he"), ("Anna", "she"), ("Sam", "he"), ("Mia", "she"), ("Leo", "he"), ("Eva", "she"))
_ITEMS = ("apple", "book", "coin", "pen", "card", "egg", "shell", "stamp")


def _problem(rng: random.Random, max_operand: int) -> tuple[str, str]:
    name, pron = rng.choice(_NAMES)
    item = rng.choice(_ITEMS)
    kind = rng.randrange(4)
    a = rng.randint(1, max_operand)
    b = rng.randint(1, max_operand)
    if kind == 0:
        n = a + b
        q = f"{name} has {a} {item}s and buys {b} more. How many {item}s does {pron} have?"
        w = f"{name} has {a}+{b}=<<{a}+{b}={n}>>{n} {item}s."
    elif kind == 1:
        a, b = max(a, b), min(a, b)
        n = a - b
        q = f"{name} has {a} {item}s and gives {b} to a friend. How many {item}s does {pron} have left?"
        w = f"{name} has {a}-{b}=<<{a}-{b}={n}>>{n} {item}s left."
    elif kind == 2:
        n = a * b
        q = f"{name} buys {a} bags with {b} {item}s in each bag. How many {item}s does {pron} buy?"
        w = f"{name} buys {a}*{b}=<<{a}*{b}={n}>>{n} {item}s."
    else:
        c = rng.randint(0, a + b)
        s = a + b
        n = s - c
        q = f"{name} has {a} {item}s, finds {b} more and then loses {c}. How many {item}s does {pron} have now?"
        w = f"After finding, {name} has {a}+{b}=<<{a}+{b}={s}>>{s} {item}s.\nAfter losing, {pron} has {s}-{c}=<<{s}-{c}={n}>>{n}."
    return q, f"{w}\n#### {n}"


def arithmetic_dataset(n_train: int = 512, n_test: int = 64, seed: int = 0, max_operand: int = 20):
    """GSM8K-shaped offline problems: a ``DatasetDict`` with "train"/"test" splits of ``question``/``answer``.

    Answers are worked like GSM8K's (with ``<<a+b=c>>`` calculator notes) and end in ``#### N``. The same
    arguments always give the same rows; train and test come from one generator, so they never share state.
    """
    from datasets import Dataset, DatasetDict

    rng = random.Random(seed)
    rows = [_problem(rng, max_operand) for _ in range(n_train + n_test)]
    splits = {"train": rows[:n_train], "test": rows[n_train:]}
    return DatasetDict(
        {
            name: Dataset.from_dict({"question": [q for q, _ in part], "answer": [a for _, a in part]})
            for name, part in splits.items()
        }
    )


_CHAIN_MAX = 199  # every running total stays in 1..199: at most three digits, so the task is the chaining itself


def _chain_problem(rng: random.Random, n_ops: int) -> tuple[str, str]:
    """One multi-step word problem: a start count and `n_ops` operations on it, each worked on its own line."""
    name, pron = rng.choice(_NAMES)
    item = rng.choice(_ITEMS)
    v = rng.randint(5, 40)
    sentences, lines = [f"{name} has {v} {item}s."], []
    while len(lines) < n_ops:
        kind = rng.randrange(4)
        if kind == 0:
            b = rng.randint(2, 30)
            r = v + b
            sentence, line = f"{pron.capitalize()} finds {b} more.", f"finds {b}: {v}+{b}={r}"
        elif kind == 1:
            if v < 3:
                continue
            b = rng.randint(1, v - 1)
            r = v - b
            sentence, line = f"{pron.capitalize()} gives away {b}.", f"gives {b}: {v}-{b}={r}"
        elif kind == 2:
            k, m = rng.randint(2, 6), rng.randint(2, 9)
            r = v + k * m
            sentence = f"{pron.capitalize()} buys {k} bags of {m}."
            line = f"buys {k} bags of {m}: {k}*{m}={k * m}, {v}+{k * m}={r}"
        else:
            r = 2 * v
            sentence, line = f"{pron.capitalize()} doubles them.", f"doubles: {v}*2={r}"
        if r > _CHAIN_MAX:
            continue
        sentences.append(sentence)
        lines.append(line)
        v = r
    question = " ".join(sentences) + f" How many {item}s does {pron} have?"
    return question, "\n".join(lines) + f"\n#### {v}"


def chain_dataset(n_train: int = 4096, n_test: int = 512, seed: int = 0, min_ops: int = 2, max_ops: int = 4):
    """Multi-step word problems with headroom: a ``DatasetDict`` with "train"/"test" splits of GSM8K's
    ``question``/``answer`` columns.

    Each problem applies `min_ops`..`max_ops` operations (find, give away, buy bags of, double) to a start count;
    the worked answer computes one line per operation (the running total, up to three digits) and ends in
    ``#### N``: 40-130 characters, so one slip anywhere in the chain makes the answer wrong. Same arguments, same
    rows; train and test come from one generator.
    """
    from datasets import Dataset, DatasetDict

    if not 1 <= min_ops <= max_ops:
        raise ValueError(f"chain_dataset needs 1 <= min_ops <= max_ops, got min_ops={min_ops}, max_ops={max_ops}.")
    rng = random.Random(seed)
    rows = [_chain_problem(rng, rng.randint(min_ops, max_ops)) for _ in range(n_train + n_test)]
    splits = {"train": rows[:n_train], "test": rows[n_train:]}
    return DatasetDict(
        {
            name: Dataset.from_dict({"question": [q for q, _ in part], "answer": [a for _, a in part]})
            for name, part in splits.items()
        }
    )


def carry_worked_answer(a: int, b: int) -> str:
    """The worked answer of "a+b" column by column, from the ones up, and ``#### a+b`` last.

    One line per column: the column's digits (and the carry in, "+1"), their sum, and the result so far (the
    column's digit prepended to the previous line's; the last column prepends its whole sum). "4738+2965":
    ``8+5=13, 3`` / ``3+6+1=10, 03`` / ``7+9+1=17, 703`` / ``4+2+1=7, 7703`` / ``#### 7703``. Each line is a
    single-digit addition (the main job's task) with a carry, and one slip in any column makes the answer wrong.
    """
    if a < 0 or b < 0:
        raise ValueError(f"carry_worked_answer adds non-negative integers, got {a} and {b}.")
    da, db = str(a)[::-1], str(b)[::-1]
    width = max(len(da), len(db))
    lines, carry, result = [], 0, ""
    for i in range(width):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        s = x + y + carry
        result = (str(s) if i == width - 1 else str(s % 10)) + result
        lines.append(f"{x}+{y}{'+1' if carry else ''}={s}, {result}")
        carry = s // 10
    return "\n".join(lines) + f"\n#### {a + b}"


def carry_dataset(n_train: int = 8192, n_test: int = 512, seed: int = 0, min_digits: int = 3, max_digits: int = 5):
    """Multi-digit additions with carries, worked column by column: a ``DatasetDict`` with "train"/"test" splits of
    GSM8K's ``question``/``answer`` columns.

    A problem adds two numbers of the same number of digits (`min_digits`..`max_digits`, drawn per problem, no
    leading zero), e.g. question "4738+2965"; the answer is `carry_worked_answer`: one line per column, then
    ``#### N`` (about 14 characters per column: 4 digits give 51-63). Train and test never share a question (test
    problems come first from one generator, then train problems that are not among them). Same arguments, same
    rows.
    """
    from datasets import Dataset, DatasetDict

    if not 1 <= min_digits <= max_digits:
        raise ValueError(
            f"carry_dataset needs 1 <= min_digits <= max_digits, got min_digits={min_digits}, max_digits={max_digits}."
        )
    distinct = sum((9 * 10 ** (d - 1)) ** 2 for d in range(min_digits, max_digits + 1))
    if n_train + n_test > distinct:
        raise ValueError(f"carry_dataset: {n_train + n_test} problems asked, {min_digits}-{max_digits} digits have "
                         f"{distinct} distinct ones.")  # fmt: skip
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[tuple[str, str]]] = {"test": [], "train": []}
    for name, n in (("test", n_test), ("train", n_train)):
        while len(splits[name]) < n:
            d = rng.randint(min_digits, max_digits)
            a, b = rng.randint(10 ** (d - 1), 10**d - 1), rng.randint(10 ** (d - 1), 10**d - 1)
            q = f"{a}+{b}"
            if q in seen:
                continue
            seen.add(q)
            splits[name].append((q, carry_worked_answer(a, b)))
    return DatasetDict(
        {
            name: Dataset.from_dict({"question": [q for q, _ in splits[name]], "answer": [a for _, a in splits[name]]})
            for name in ("train", "test")
        }
    )


def addition_dataset(seed: int = 0, max_operand: int = 9):
    """Every single-digit addition "a+b" once (100 rows), shuffled, in GSM8K's question/answer columns.

    The task of the offline main job: prompts and answers of a few characters keep a CPU GRPO run to minutes.
    """
    from datasets import Dataset

    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    return Dataset.from_dict(
        {
            "question": [f"{a}+{b}" for a, b in pairs],
            "answer": [f"{a}+{b}=<<{a}+{b}={a + b}>>\n#### {a + b}" for a, b in pairs],
        }
    )


def load_math_dataset(name_or_path: str | None = None, split: str | None = "train", **kwargs):
    """Load a math data set with GSM8K's ``question``/``answer`` columns.

    ``None`` or ``"offline-arithmetic"`` give `arithmetic_dataset` (keyword arguments go to it); ``"openai/gsm8k"``
    (or ``"gsm8k"``) loads config ``"main"`` with ``datasets.load_dataset``; a directory written by
    ``save_to_disk`` is loaded with ``load_from_disk``; any other name or path goes to ``load_dataset``.
    ``split=None`` returns every split.
    """
    if name_or_path is None or name_or_path == OFFLINE_DATASET:
        ds = arithmetic_dataset(**kwargs)
        return ds if split is None else ds[split]
    import datasets

    if os.path.isdir(name_or_path) and (
        os.path.exists(os.path.join(name_or_path, "dataset_dict.json"))
        or os.path.exists(os.path.join(name_or_path, "state.json"))
    ):
        ds = datasets.load_from_disk(name_or_path)
        return ds[split] if split is not None and isinstance(ds, datasets.DatasetDict) else ds
    if name_or_path in ("openai/gsm8k", "gsm8k"):
        return datasets.load_dataset("openai/gsm8k", kwargs.pop("name", "main"), split=split, **kwargs)
    return datasets.load_dataset(name_or_path, split=split, **kwargs)


def format_prompt(question: str) -> str:
    """The plain-text prompt the model completes: short, so the character tokenizer keeps it cheap."""
    return f"Q: {question.strip()}\nA:"


def to_grpo_dataset(ds):
    """Add TRL's ``prompt`` column (plain text) to every row; ``answer`` stays for the reward function.

    Works on a ``Dataset`` or a ``DatasetDict``.
    """
    return ds.map(lambda row: {"prompt": format_prompt(row["question"])})


# ----------------------------------------------------------------------------------------------------------
# Reward
# ----------------------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)")


def _canonical(num: str) -> str | None:
    try:
        d = Decimal(num.replace(",", ""))
    except InvalidOperation:
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def extract_final_number(text: str) -> str | None:
    """The answer a text commits to, as a canonical string ("1,234.50" -> "1234.5", "-0" -> "0"), or None.

    GSM8K-style answers put it after the last ``####``; otherwise it is the last number in the text.
    """
    if text is None:
        return None
    marker = text.rfind("####")
    if marker >= 0:
        found = _NUMBER.search(text[marker + 4 :])
        return _canonical(found.group()) if found else None
    found = _NUMBER.findall(text)
    return _canonical(found[-1]) if found else None


def _completion_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):  # TRL's conversational form: [{"role": "assistant", "content": ...}]
        return "".join(m.get("content", "") if isinstance(m, dict) else str(m) for m in completion)
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    return str(completion)


def arithmetic_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """TRL reward function: 1.0 where a completion's final number equals the reference's ``#### N``, else 0.0.

    Takes plain-text or conversational completions; TRL passes the data set's ``answer`` column by name.
    """
    rewards = []
    for completion, ref in zip(completions, answer, strict=True):
        want = extract_final_number(ref)
        got = extract_final_number(_completion_text(completion))
        rewards.append(1.0 if want is not None and got == want else 0.0)
    return rewards


_MARKED = re.compile(r"^#### *(-?\d+(?:,\d{3})*(?:\.\d+)?)\s*$", re.MULTILINE)


def exact_answer_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """TRL reward function, strict: 1.0 where a completion's ``#### N`` line (the first one) states the reference's
    final number, else 0.0.

    Unlike `arithmetic_reward` there is no fallback to the last number in the text: a completion cut off by the
    length limit, or one that never writes the ``#### N`` line, scores 0 even if its last number is right.
    """
    rewards = []
    for completion, ref in zip(completions, answer, strict=True):
        want = extract_final_number(ref)
        found = _MARKED.search(_completion_text(completion))
        got = _canonical(found.group(1)) if found else None
        rewards.append(1.0 if want is not None and got == want else 0.0)
    return rewards
