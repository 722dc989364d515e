"""Gemma 2 and Gemma 3 GGUF files served as they are (llama.cpp's gemma2 / gemma3: each norm stored
as 1 + w, soft-capping, the sliding-window patterns, Gemma 3's q/k norms and linear rope scaling of
its global layers), against transformers running the file's dequantized tensors. Files written by
tests/gguf_models.py from random checkpoints of transformers' own classes."""

from __future__ import annotations

import pytest
import torch

from nanoserve.models.gguf.model import gguf_hf_config
from tests.gguf_models import assert_greedy_logprobs_match, dequantized_gemma, write_gemma_gguf
from tests.models.test_compressed_tensors import GREEDY, PROMPTS
from tests.models.test_gguf_moe import build

# The last prompt is longer than the files' sliding window (24 tokens): the window slides.
LONG_PROMPTS = PROMPTS + [
    "In the morning the market opened early, and the traders who had waited all night "
    "for the news from the harbour began to shout their prices across the square"
]


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma_file(request, tmp_path_factory):
    return write_gemma_gguf(tmp_path_factory.mktemp(request.param), request.param, "q4_1", seed=7)


def test_config_from_the_metadata(gemma_file):
    config = gguf_hf_config(gemma_file)
    hf = dequantized_gemma(gemma_file).config
    assert config["architectures"] == hf.architectures
    assert config["layer_types"] == hf.layer_types and config["sliding_window"] == hf.sliding_window
    assert (
        config["query_pre_attn_scalar"] == hf.query_pre_attn_scalar
        and config["head_dim"] == hf.head_dim
    )
    assert (
        config["tie_word_embeddings"] is True
        and config["hidden_activation"] == hf.hidden_activation
    )
    if hf.model_type == "gemma2":
        assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (
            hf.attn_logit_softcapping,
            hf.final_logit_softcapping,
        )
    else:
        full, sliding = (
            hf.rope_parameters["full_attention"],
            hf.rope_parameters["sliding_attention"],
        )
        assert (
            config["rope_theta"] == full["rope_theta"]
            and config["rope_local_base_freq"] == sliding["rope_theta"]
        )
        assert config["rope_scaling"] == {"rope_type": "linear", "factor": full["factor"]}


def test_norms_are_the_files_factors_minus_one(gemma_file):
    model = build(gemma_file, dtype="float32").llm_engine.runner.model
    oracle = dequantized_gemma(gemma_file)
    ours = {name: p for name, p in model.named_parameters() if "norm" in name}
    assert len(ours) == len([name for name, _ in oracle.named_parameters() if "norm" in name]) > 0
    for name, param in oracle.named_parameters():
        if "norm" in name:
            assert torch.equal(ours[name], param), name


@torch.inference_mode()
def test_logprobs_match_transformers_on_the_files_blocks(gemma_file, exact_gemm):
    """The engine's greedy tokens teacher-forced through transformers' Gemma holding the file's
    tensors dequantized, both sides' GEMMs the same exact product: every logprob to float32
    rounding, each token the argmax (one prompt longer than the sliding window)."""
    model = dequantized_gemma(gemma_file)
    llm = build(gemma_file, dtype="float32")
    assert len(llm.get_tokenizer().encode(LONG_PROMPTS[-1])) > model.config.sliding_window
    assert_greedy_logprobs_match(model, llm, LONG_PROMPTS, GREEDY)


@pytest.mark.parametrize("family", ["gemma3", "phi4-mini"])
def test_import_into_a_directory_transformers_loads(family, tmp_path):
    """`nanoserve import-model --gguf FILE` of a Gemma 3 or Phi-4-mini file: a directory transformers
    itself loads (its config.json read by transformers' own classes), every parameter the file's
    value in bf16 (Gemma's norms back to w; Phi's fused layers and LongRoPE factors)."""
    from transformers import AutoModelForCausalLM

    from nanoserve.models.gguf.importer import import_gguf
    from tests.gguf_models import dequantized_phi3, write_phi3_gguf

    if family == "gemma3":
        path, oracle = (
            write_gemma_gguf(tmp_path / "file", family, "q8_0", seed=3),
            dequantized_gemma,
        )
    else:
        path, oracle = write_phi3_gguf(tmp_path / "file", family, "q8_0", seed=3), dequantized_phi3
    out_dir = import_gguf(path, tmp_path / "models" / family)
    imported = dict(
        AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).named_parameters()
    )
    expected = dict(oracle(path).named_parameters())
    assert imported.keys() == expected.keys()
    for name, param in expected.items():
        assert torch.equal(imported[name], param.detach().bfloat16().float()), name
