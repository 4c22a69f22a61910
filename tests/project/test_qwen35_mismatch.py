# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The Qwen3.5 mismatch benchmark's smoke path: every row it writes, on CPU in a few seconds."""

import json

import pytest
import torch

from benchmarks.mismatch import qwen35_mismatch as Q
from trace_hf import testing as T


def test_smoke_rows_and_fla_reason(tmp_path):
    out = tmp_path / "m.json"
    Q.main(["--out", str(out), "--warm-steps", "2", "--rows", "2", "--new", "4", "--fla", "--engine"])
    r = json.loads(out.read_text())
    for key in (
        "float32_train_chunked",
        "float32_train_recurrent",
        "bfloat16_train_chunked",
        "bfloat16_train_recurrent",
    ):
        assert set(r[key]) >= {"mean_abs_logp_diff", "max_abs_logp_diff", "kl_k3", "layers"}
        assert [row["type"] for row in r[key]["layers"]] == r["layer_types"]
        assert all({"mixer", "moe", "layer", "mixer_local", "moe_local"} <= set(row) for row in r[key]["layers"])
    # fp32 with the same recurrent rule on both sides: only summation order differs.
    assert r["float32_train_recurrent"]["max_abs_logp_diff"] < 1e-4
    # The first layer's inputs are the embeddings on both sides: its mixer's delta is its own.
    row0 = r["float32_train_chunked"]["layers"][0]
    assert row0["mixer_local"] == pytest.approx(row0["mixer"], rel=1e-6)
    # On CPU fla cannot run: recorded with the reason, no fla rows, no crash.
    assert r["fla"]["available"] is False and "CUDA" in r["fla"]["reason"]
    assert not any(k.startswith("bfloat16_fla") for k in r)
    eng = r["bfloat16_engine"]
    assert "error" not in eng, eng
    assert eng["tokens"] > 0 and eng["train_torch_chunked"]["mean_abs_logp_diff"] < 0.1


def test_delta_rule_swaps_and_restores():
    M = Q._module()
    before = M.torch_chunk_gated_delta_rule, M.torch_recurrent_gated_delta_rule
    calls = []
    torch_k = Q.torch_kernels()

    def chunk(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False):
        calls.append("chunk")
        return torch_k["chunk"](q, k, v, g=g, beta=beta, initial_state=initial_state,
                                output_final_state=output_final_state,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)  # fmt: skip

    tok = T.build_char_tokenizer()
    model = T.tiny_model("qwen3_5_moe_text", tokenizer=tok).eval()
    ids = tok(["12+3="], return_tensors="pt").input_ids
    with torch.no_grad(), Q.delta_rule({"chunk": chunk, "recurrent": torch_k["recurrent"]}):
        model(input_ids=ids)
    assert calls.count("chunk") == sum(t == "linear_attention" for t in model.config.layer_types)
    assert (M.torch_chunk_gated_delta_rule, M.torch_recurrent_gated_delta_rule) == before
