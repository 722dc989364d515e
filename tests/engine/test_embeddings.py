"""Pooling models (LLM.embed) against transformers' last hidden state with the same pooling, in
fp32 (cosine > 0.9999): last-token and mean pooling, normalized or not, as the checkpoint's
sentence-transformers files or --pooler-config say; a headless MistralModel checkpoint served as
a pooling model on its own; chunked prompts; Matryoshka dimensions; tp=2; and what a pooling
model refuses (generating) and a generating one refuses (embedding)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from nanoserve import LLM, PoolingParams, SamplingParams
from nanoserve.errors import InvalidRequestError
from tests.conftest import build_tokenizer
from tests.helpers import write_sentence_transformers_files
from tests.models.family_checkpoints import write_random_checkpoint


def prompts(count: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(rng.randint(3, 45))] for _ in range(count)]


def hf_embeddings(model_dir, token_lists, pooling: str, normalize: bool) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for ids in token_lists:
        with torch.inference_mode():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        vector = (
            hidden[-1]
            if pooling == "LAST"
            else hidden.mean(dim=0)
            if pooling == "MEAN"
            else hidden[0]
        )
        out.append(torch.nn.functional.normalize(vector, dim=0) if normalize else vector)
    return out


def check_close(results, expected) -> None:
    for result, reference in zip(results, expected, strict=True):
        ours = torch.tensor(result.outputs.embedding)
        assert ours.shape == reference.shape
        assert torch.nn.functional.cosine_similarity(ours, reference, dim=0) > 0.9999
        assert torch.allclose(ours, reference, rtol=1e-3, atol=1e-4)


def embed(llm: LLM, token_lists, params=None):
    return llm.embed([{"prompt_token_ids": ids} for ids in token_lists], params, use_tqdm=False)


@pytest.mark.parametrize(
    "pooler, pooling, normalize",
    [
        (None, "LAST", True),
        ('{"pooling_type": "MEAN"}', "MEAN", True),
        ('{"pooling_type": "CLS", "normalize": false}', "CLS", False),
    ],
)
def test_llama_pooling_equals_transformers(tiny_llama_dir, pooler, pooling, normalize):
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        runner="pooling",
        pooler_config=pooler,
        num_kv_blocks=128,
    )
    token_lists = prompts()
    check_close(
        embed(llm, token_lists), hf_embeddings(tiny_llama_dir, token_lists, pooling, normalize)
    )
    assert llm.llm_engine.stats().prompt_tokens_total == sum(map(len, token_lists))


def test_sentence_transformers_files_choose_mean_and_normalize(tmp_path):
    """A Qwen3-Embedding-like checkpoint: Qwen3ForCausalLM weights with modules.json saying mean
    pooling then Normalize; --task embed (vLLM's older flag) serves it."""
    model_dir = write_random_checkpoint(tmp_path / "qwen3-embed", "qwen3")
    pooling = {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}
    write_sentence_transformers_files(model_dir, pooling)
    llm = LLM(model=str(model_dir), dtype="float32", task="embed", num_kv_blocks=128)
    token_lists = prompts(seed=1)
    check_close(embed(llm, token_lists), hf_embeddings(model_dir, token_lists, "MEAN", True))


def write_headless_mistral(out_dir):
    from transformers import MistralConfig, MistralModel

    out_dir.mkdir(parents=True)
    vocab = build_tokenizer(out_dir)
    config = MistralConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=None,
    )
    torch.manual_seed(3)
    MistralModel(config).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def test_headless_checkpoint_is_a_pooling_model(tmp_path):
    model_dir = write_headless_mistral(tmp_path / "e5-like")
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["MistralModel"]
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128)  # no --runner needed
    token_lists = prompts(seed=2)
    check_close(embed(llm, token_lists), hf_embeddings(model_dir, token_lists, "LAST", True))
    with pytest.raises(ValueError, match="runner pooling"):
        LLM(model=str(model_dir), runner="generate")


def test_chunked_prompts_pool_the_same(tiny_llama_dir):
    token_lists = prompts(seed=3) + [list(range(3, 300))]
    whole = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        runner="pooling",
        num_kv_blocks=128,
        pooler_config='{"pooling_type": "MEAN"}',
    )
    chunked = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        runner="pooling",
        num_kv_blocks=128,
        pooler_config='{"pooling_type": "MEAN"}',
        max_num_batched_tokens=32,
    )
    for a, b in zip(embed(whole, token_lists), embed(chunked, token_lists)):
        assert torch.allclose(
            torch.tensor(a.outputs.embedding),
            torch.tensor(b.outputs.embedding),
            rtol=1e-4,
            atol=1e-5,
        )


def test_matryoshka_dimensions(tmp_path, tiny_llama_dir):
    import shutil

    model_dir = tmp_path / "matryoshka"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32, 64]
    (model_dir / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(model_dir), dtype="float32", runner="pooling", num_kv_blocks=128)
    token_lists = prompts(2, seed=4)
    full = hf_embeddings(model_dir, token_lists, "LAST", False)
    cut = [torch.nn.functional.normalize(vector[:32], dim=0) for vector in full]
    check_close(embed(llm, token_lists, PoolingParams(dimensions=32)), cut)
    with pytest.raises(InvalidRequestError, match="matryoshka dimensions"):
        embed(llm, token_lists, PoolingParams(dimensions=20))
    plain = LLM(model=str(tiny_llama_dir), dtype="float32", runner="pooling", num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="does not support matryoshka"):
        embed(plain, token_lists, PoolingParams(dimensions=32))


def test_what_each_kind_of_model_refuses(tiny_llama_dir):
    pooling = LLM(model=str(tiny_llama_dir), dtype="float32", runner="pooling", num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="does not generate"):
        pooling.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    generating = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="does not embed"):
        generating.embed([[5, 6, 7]], use_tqdm=False)
    with pytest.raises(ValueError, match="disagree"):
        LLM(model=str(tiny_llama_dir), runner="generate", task="embed")
    with pytest.raises(ValueError, match="pooling_type"):
        LLM(model=str(tiny_llama_dir), runner="pooling", pooler_config='{"pooling_type": "MAX"}')


def test_tensor_parallel_embeddings_equal_one_rank(tiny_llama_dir):
    token_lists = prompts(seed=5)
    one = embed(
        LLM(model=str(tiny_llama_dir), dtype="float32", runner="pooling", num_kv_blocks=64),
        token_lists,
    )
    with LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        runner="pooling",
        num_kv_blocks=64,
        tensor_parallel_size=2,
    ) as llm:
        two = embed(llm, token_lists)
    for a, b in zip(one, two):
        assert torch.allclose(
            torch.tensor(a.outputs.embedding),
            torch.tensor(b.outputs.embedding),
            rtol=1e-4,
            atol=1e-5,
        )
