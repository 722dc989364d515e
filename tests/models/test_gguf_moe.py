"""GGUF files of the Qwen3 family and of mixtures of experts served as they are (llama.cpp's
qwen3, qwen3moe, qwen2moe with its shared expert, and a "llama" file with experts: Mixtral): config from the metadata, each
expert's rows kept in the file's blocks (FusedMoE's quantized experts), and the model equal to
transformers running the file's dequantized tensors. Files written by tests/gguf_models.py from
random checkpoints of transformers' own classes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from nanoserve import LLM
from nanoserve.kernels import quant
from nanoserve.models.gguf.importer import import_gguf
from nanoserve.models.gguf.model import gguf_hf_config
from tests.gguf_models import (
    dequantized_transformers,
    teacher_forced,
    write_moe_gguf,
    write_qwen3_gguf,
)
from tests.models.test_compressed_tensors import (
    PROMPTS,
    assert_moe_tensor_parallel_equals_one_rank,
    greedy,
)

MOE_FILES = {
    "qwen3_moe-q4_1": ("qwen3_moe", "q4_1"),
    "qwen3_moe-q8_0": ("qwen3_moe", "q8_0"),
    "mixtral-q4_0": ("mixtral", "q4_0"),
    "qwen2_moe-q4_1": ("qwen2_moe", "q4_1"),
}


@pytest.fixture(scope="module", params=list(MOE_FILES))
def moe_file(request, tmp_path_factory):
    family, experts = MOE_FILES[request.param]
    return write_moe_gguf(tmp_path_factory.mktemp(request.param), family, experts, seed=11)


def build(path, **kwargs) -> LLM:
    return LLM(model=str(path), num_kv_blocks=64, device="cpu", **kwargs)


def test_config_from_the_metadata(tmp_path):
    qwen = gguf_hf_config(write_moe_gguf(tmp_path / "qwen", "qwen3_moe"))
    assert qwen["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (qwen["num_experts"], qwen["num_experts_per_tok"], qwen["moe_intermediate_size"]) == (
        8,
        8,
        32,
    )
    assert qwen["norm_topk_prob"] is True and qwen["head_dim"] == 16
    mixtral = gguf_hf_config(write_moe_gguf(tmp_path / "mixtral", "mixtral"))
    assert mixtral["architectures"] == ["MixtralForCausalLM"]
    assert (
        mixtral["num_local_experts"],
        mixtral["num_experts_per_tok"],
        mixtral["intermediate_size"],
    ) == (8, 2, 32)
    assert gguf_hf_config(write_qwen3_gguf(tmp_path / "qwen3"))["architectures"] == [
        "Qwen3ForCausalLM"
    ]
    qwen2 = gguf_hf_config(write_moe_gguf(tmp_path / "qwen2", "qwen2_moe"))
    assert qwen2["architectures"] == ["Qwen2MoeForCausalLM"] and qwen2["norm_topk_prob"] is False
    assert (
        qwen2["num_experts"],
        qwen2["moe_intermediate_size"],
        qwen2["shared_expert_intermediate_size"],
    ) == (8, 32, 64)
    assert qwen2["attention_bias"] is True and qwen2["mlp_only_layers"] == []


def test_experts_hold_the_files_blocks(moe_file):
    """Every expert's gate/up and down matrices are one QuantWeight of the file's type each (no
    float copy): gate rows then up rows, each expert's exactly as the gguf package dequantizes
    them."""
    reader = gguf.GGUFReader(moe_file)
    tensors = {t.name: t for t in reader.tensors}

    def meaning(name, expert):
        values = gguf.quants.dequantize(
            np.asarray(tensors[name].data[expert]), tensors[name].tensor_type
        )
        return torch.from_numpy(np.array(values, dtype=np.float32))

    model = build(moe_file, dtype="float32").llm_engine.runner.model
    for index, layer in enumerate(model.model.layers):
        moe = layer.mlp.experts
        assert moe.w13_weight.is_meta and moe.w2_weight.is_meta
        qtype = tensors[f"blk.{index}.ffn_gate_exps.weight"].tensor_type.name.lower()
        assert qtype in {experts for _, experts in MOE_FILES.values()}
        for expert, (w13, w2) in enumerate(
            zip(moe.expert_weights.quantized("w13"), moe.expert_weights.quantized("w2"))
        ):
            assert w13.qtype == w2.qtype == qtype and w13.packed is not None
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


def assert_logprobs_match_transformers(path) -> None:
    """The engine's greedy tokens teacher-forced through transformers holding the file's tensors
    dequantized: every logprob within 1e-3, each token the argmax."""
    model = dequantized_transformers(path)
    llm = build(path, dtype="float32")
    tokens, logprobs, _ = greedy(llm)
    forced = teacher_forced(model, llm.get_tokenizer(), PROMPTS, tokens)
    for prompt, ours, (rows, theirs) in zip(PROMPTS, logprobs, forced):
        assert all(abs(a - b) < 1e-3 for a, b in zip(ours, theirs)), prompt
        assert all(row.max().item() - value < 1e-3 for row, value in zip(rows, theirs)), prompt


@torch.inference_mode()
def test_logprobs_match_transformers_on_the_files_blocks(moe_file, exact_gemm):
    """The engine's greedy tokens teacher-forced through transformers holding the file's tensors
    dequantized (stacked experts, router, Q/K rows un-permuted for Mixtral), both sides' quantized
    GEMMs the same exact product: every logprob to float32 rounding, each token the argmax."""
    assert_logprobs_match_transformers(moe_file)


def test_kernels_equal_reference_gemm_bit_for_bit(moe_file, monkeypatch):
    """The experts on the CPU kernel's packing against the same engine whose quantized weights go
    through quant.reference_gemm (nothing packed; the kernel's int8 arithmetic in torch): the same
    tokens and logprob bits."""
    ours = greedy(build(moe_file, dtype="float32"))
    monkeypatch.setattr(quant, "pack_for_cpu", lambda weight: None)
    reference = greedy(build(moe_file, dtype="float32"))
    assert ours[0] == reference[0] and ours[1] == reference[1]


def test_qwen3_file_logprobs_match_transformers(tmp_path, exact_gemm):
    """A dense qwen3 file: Q/K norms from attn_q_norm / attn_k_norm, rows in Hugging Face's order."""
    assert_logprobs_match_transformers(write_qwen3_gguf(tmp_path, "q4_1", seed=3))


@pytest.mark.parametrize("expert_inter", [64, 32])
def test_tensor_parallel_equals_one_rank(expert_inter, tmp_path):
    """tp=2 (gloo), split along the intermediate dimension and with --enable-expert-parallel: each
    rank keeps its experts' rows, and whole Q8_0 blocks of the down matrices' inputs, in the
    file's blocks; the tokens equal one rank's. An intermediate size of 32 is 16 inputs a rank,
    not a block: the down matrices are then dequantized at load (their inputs stay float, so the
    logprobs move by the int8 rounding one rank's kernels do)."""
    path = write_moe_gguf(tmp_path, "qwen3_moe", "q8_0", seed=6, expert_inter=expert_inter)
    assert_moe_tensor_parallel_equals_one_rank(path, expert_inter)


def test_a_moe_file_is_not_imported_into_a_directory(tmp_path):
    path = write_moe_gguf(tmp_path, "qwen3_moe")
    with pytest.raises(ValueError, match="mixture-of-experts GGUF file is served as it is"):
        import_gguf(path, tmp_path / "out")
