"""Phi-3 and Phi-4-mini GGUF files served as they are (llama.cpp's phi3: fused attn_qkv and ffn_up,
the sliding window, Phi-4-mini's partial rotary and LongRoPE factors stored as tensors), against
transformers running the file's dequantized tensors. Files written by tests/gguf_models.py from
random checkpoints of transformers' own classes (tests/models/family_checkpoints.py)."""

from __future__ import annotations

import pytest
import torch

from nanoserve.models.gguf.model import gguf_hf_config
from tests.gguf_models import assert_greedy_logprobs_match, dequantized_phi3, write_phi3_gguf
from tests.models.family_checkpoints import LONGROPE_SWITCH
from tests.models.test_compressed_tensors import GREEDY, PROMPTS
from tests.models.test_gguf_moe import build

# The last prompt is longer than the files' sliding window (24 tokens), and with its output shorter
# than Phi-4-mini's LongRoPE switch point (transformers takes one factor set for a whole forward).
LONG_PROMPTS = PROMPTS + ["In the morning the market opened early and the traders began to shout"]


@pytest.fixture(scope="module", params=["phi3", "phi4-mini"])
def phi3_file(request, tmp_path_factory):
    return write_phi3_gguf(tmp_path_factory.mktemp(request.param), request.param, "q4_1", seed=9)


def test_config_from_the_metadata(phi3_file):
    config = gguf_hf_config(phi3_file)
    hf = dequantized_phi3(phi3_file).config
    rope = hf.rope_parameters
    assert (
        config["architectures"] == ["Phi3ForCausalLM"]
        and config["sliding_window"] == hf.sliding_window
    )
    assert config["head_dim"] == hf.hidden_size // hf.num_attention_heads
    assert config["partial_rotary_factor"] == rope.get("partial_rotary_factor", 1.0)
    if rope.get("rope_type") == "longrope":
        assert config["rope_scaling"] == {
            "rope_type": "longrope",
            "short_factor": rope["short_factor"],
            "long_factor": rope["long_factor"],
            "original_max_position_embeddings": rope["original_max_position_embeddings"],
        }
    else:
        assert config["rope_scaling"] is None


@torch.inference_mode()
def test_logprobs_match_transformers_on_the_files_blocks(phi3_file, exact_gemm):
    """Greedy tokens teacher-forced through transformers' Phi-3 holding the file's tensors
    dequantized, both sides' GEMMs the same exact product: every logprob to float32 rounding,
    each token the argmax (one prompt longer than the sliding window)."""
    model = dequantized_phi3(phi3_file)
    llm = build(phi3_file, dtype="float32")
    length = len(llm.get_tokenizer().encode(LONG_PROMPTS[-1]))
    assert model.config.sliding_window < length < LONGROPE_SWITCH - GREEDY.max_tokens
    assert_greedy_logprobs_match(model, llm, LONG_PROMPTS, GREEDY)


def test_fused_layers_keep_the_files_blocks_and_split_under_tensor_parallel(phi3_file):
    """attn_qkv and ffn_up stay in their blocks (one quantized weight each), and tp=2 (gloo) gives
    one rank's tokens: each rank takes its heads' rows of q, k and v and its rows of gate and up."""
    with build(phi3_file, dtype="float32") as llm:
        layer = llm.llm_engine.runner.model.model.layers[0]
        assert (
            layer.self_attn.qkv_proj.weight_form.quantized
            and layer.mlp.gate_up_proj.weight_form.quantized
        )
        one = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with build(phi3_file, dtype="float32", tensor_parallel_size=2) as llm:
        assert [
            list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        ] == one
