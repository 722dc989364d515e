"""gpt-oss GGUF files served as they are (llama.cpp's "gpt-oss" architecture, as ggml-org's
gpt-oss-20b / 120b files): config from the metadata (YaRN, the sliding window on every other
layer, attention sinks), each expert's rows kept in the file's MXFP4 blocks, the expert biases
split as llama.cpp's converter splits them, and the model equal to transformers' gpt-oss running
the file's dequantized tensors. Files written by tests/gguf_models.py from a random checkpoint of
transformers' own class (tests/models/moe_checkpoints.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from nanoserve.kernels import quant
from nanoserve.models.gguf.model import gguf_hf_config, gguf_tokenizer
from nanoserve.models.gguf.tokenizer import _pre_tokenizer
from nanoserve.models.gguf.weights import mxfp4_components
from tests.gguf_models import dequantized_gpt_oss, teacher_forced, write_moe_gguf
from tests.models.test_compressed_tensors import (
    PROMPTS,
    assert_moe_tensor_parallel_equals_one_rank,
    greedy,
)
from tests.models.test_gguf_moe import build


@pytest.fixture(scope="module")
def gpt_oss_file(tmp_path_factory):
    return write_moe_gguf(tmp_path_factory.mktemp("gpt-oss"), "gpt_oss", "mxfp4", seed=5)


def test_config_from_the_metadata(gpt_oss_file):
    config = gguf_hf_config(gpt_oss_file)
    hf = dequantized_gpt_oss(gpt_oss_file).config
    assert config["architectures"] == ["GptOssForCausalLM"] and config["model_type"] == "gpt_oss"
    assert (
        config["num_local_experts"],
        config["num_experts_per_tok"],
        config["intermediate_size"],
    ) == (hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size)
    assert config["head_dim"] == hf.head_dim and config["attention_bias"] is True
    assert config["sliding_window"] == hf.sliding_window and config["layer_types"] == hf.layer_types
    yarn = hf.rope_parameters
    assert config["rope_theta"] == yarn["rope_theta"]
    assert config["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": yarn["factor"],
        "beta_fast": yarn["beta_fast"],
        "beta_slow": yarn["beta_slow"],
        "truncate": False,
        "original_max_position_embeddings": yarn["original_max_position_embeddings"],
    }


def test_mxfp4_components_are_the_gguf_packages_values():
    """Random GGUF MXFP4 blocks (every exponent byte, including the two below ggml's normal
    range, and every code) through mxfp4_components and the kernels' dequantization: bit for bit
    gguf.quants.dequantize."""
    rng = np.random.default_rng(0)
    rows, k = 24, 256
    raw = rng.integers(0, 256, (rows, k // 32, 17), dtype=np.uint8)
    raw[..., 0] %= 251  # exponents up to 250: 12 x 2^(e - 128) stays finite
    raw[0, :, 0] = np.arange(k // 32)  # exponents 0..7: 0 and 1 are ggml's subnormal halves
    raw[1, :, 0] = 250 - np.arange(k // 32)  # the largest that keep 12 x 2^(e - 128) finite
    raw = raw.reshape(rows, -1)
    components = mxfp4_components(torch.from_numpy(raw), k)
    weight = quant.QuantWeight(
        quant.MXFP4,
        rows,
        k,
        None,
        components=quant.QuantComponents(components["u"], components["scale"]),
    )
    ours = quant.dequantize_weight(weight)
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4).astype(np.float32)
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))


def test_experts_hold_the_files_mxfp4_blocks(gpt_oss_file):
    """Every expert's gate/up and down matrices are one MXFP4 QuantWeight each (no float copy), the
    values the gguf package reads from the file; the expert biases, sinks and router as the file's."""
    reader = gguf.GGUFReader(gpt_oss_file)
    tensors = {t.name: t for t in reader.tensors}

    def meaning(name, expert=None):
        data = tensors[name].data if expert is None else tensors[name].data[expert]
        values = gguf.quants.dequantize(np.asarray(data), tensors[name].tensor_type)
        return torch.from_numpy(np.array(values, dtype=np.float32))

    model = build(gpt_oss_file, dtype="float32").llm_engine.runner.model
    for index, layer in enumerate(model.model.layers):
        moe = layer.mlp.experts
        assert moe.w13_weight.is_meta and moe.w2_weight.is_meta
        for expert, (w13, w2) in enumerate(
            zip(moe.expert_weights.quantized("w13"), moe.expert_weights.quantized("w2"))
        ):
            assert w13.qtype == w2.qtype == quant.MXFP4 and w13.packed is not None
            gate_up = torch.cat(
                [
                    meaning(f"blk.{index}.ffn_gate_exps.weight", expert),
                    meaning(f"blk.{index}.ffn_up_exps.weight", expert),
                ]
            )
            assert torch.equal(quant.dequantize_weight(w13), gate_up)
            assert torch.equal(
                quant.dequantize_weight(w2), meaning(f"blk.{index}.ffn_down_exps.weight", expert)
            )
        biases = torch.cat(
            [meaning(f"blk.{index}.ffn_gate_exps.bias"), meaning(f"blk.{index}.ffn_up_exps.bias")],
            1,
        )
        assert torch.equal(moe.w13_bias, biases)
        assert torch.equal(moe.w2_bias, meaning(f"blk.{index}.ffn_down_exps.bias"))
        assert torch.equal(
            layer.self_attn.attn.sinks.float(), meaning(f"blk.{index}.attn_sinks.weight")
        )
        assert torch.equal(layer.mlp.router.weight, meaning(f"blk.{index}.ffn_gate_inp.weight"))


@torch.inference_mode()
def test_logprobs_match_transformers_on_the_files_blocks(gpt_oss_file, exact_gemm):
    """The engine's greedy tokens teacher-forced through transformers' gpt-oss holding the file's
    tensors dequantized, both sides' quantized GEMMs the same exact product: every logprob to
    float32 rounding, each token the argmax. The prompts are longer than the sliding window."""
    model = dequantized_gpt_oss(gpt_oss_file)
    llm = build(gpt_oss_file, dtype="float32")
    shortest = min(len(llm.get_tokenizer().encode(prompt)) for prompt in PROMPTS)
    assert shortest + 12 > model.config.sliding_window  # the window slides within every sequence
    tokens, logprobs, _ = greedy(llm)
    forced = teacher_forced(model, llm.get_tokenizer(), PROMPTS, tokens)
    for prompt, ours, (rows, theirs) in zip(PROMPTS, logprobs, forced):
        assert all(abs(a - b) < 1e-3 for a, b in zip(ours, theirs)), prompt
        assert all(row.max().item() - value < 1e-3 for row, value in zip(rows, theirs)), prompt


def test_kernels_equal_reference_gemm_bit_for_bit(gpt_oss_file, monkeypatch):
    """The experts on the CPU kernel's MXFP4 packing against the same engine whose quantized weights
    go through quant.reference_gemm (nothing packed): the same tokens and logprob bits."""
    ours = greedy(build(gpt_oss_file, dtype="float32"))
    monkeypatch.setattr(quant, "pack_for_cpu", lambda weight: None)
    reference = greedy(build(gpt_oss_file, dtype="float32"))
    assert ours[0] == reference[0] and ours[1] == reference[1]


def test_tensor_parallel_equals_one_rank(tmp_path):
    """tp=2 (gloo) split along the intermediate dimension (each rank its share of the gate / up
    biases, the down bias once) and with --enable-expert-parallel: the tokens equal one rank's."""
    path = write_moe_gguf(tmp_path, "gpt_oss", "mxfp4", seed=6, expert_inter=64)
    assert_moe_tensor_parallel_equals_one_rank(path, 64)


def test_end_of_turn_tokens_stop_generation(gpt_oss_file, tmp_path):
    """A gpt-oss file's generation also ends at the harmony format's <|return|> and <|call|> and at
    <|endoftext|>, those of them its vocabulary has (the test vocabulary: <|endoftext|>), as
    gpt-oss's generation_config.json lists them; another family's at its eos token alone."""
    tokenizer = gguf_tokenizer(gpt_oss_file)
    eos, end_of_text = (
        gguf_hf_config(gpt_oss_file)["eos_token_id"],
        tokenizer.encode("<|endoftext|>"),
    )
    assert len(end_of_text) == 1 and end_of_text[0] != eos
    assert tokenizer.eos_token_ids == {eos, end_of_text[0]}
    qwen = write_moe_gguf(tmp_path, "qwen3_moe")
    assert gguf_tokenizer(qwen).eos_token_ids == {gguf_hf_config(qwen)["eos_token_id"]}


def test_gpt_4o_pre_tokenizer_splits_as_o200k():
    """llama.cpp's "gpt-4o" pre-tokenizer (gpt-oss's vocabulary): tiktoken's o200k_base split, on
    pieces worked out by hand from its pattern: a word with its contraction, a lowercase run ending
    at a capital (fooBar) but capitals before lowercase kept whole (HTTPServer), digits in threes
    after a lone space, a punctuation run, newlines together, and the space before a word left to
    the word."""
    text = "He's fooBar HTTPServer 12345 a+/b\n\n  x"
    pieces = [piece for piece, _ in _pre_tokenizer("gpt-4o").pre_tokenize_str(text)]
    # byte-level: a space is Ġ and a newline Ċ
    assert pieces == [
        "He's",
        "Ġfoo",
        "Bar",
        "ĠHTTPServer",
        "Ġ",
        "123",
        "45",
        "Ġa",
        "+/",
        "b",
        "ĊĊ",
        "Ġ",
        "Ġx",
    ]
