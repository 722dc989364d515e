"""Tokenizer wrapper, chat templates and the incremental detokenizer, on the default model's tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from nanoserve.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Plain ASCII text, with punctuation; and numbers 1234.",
    "Café naïve résumé — Ærøskøbing, Zürich, façade, Ελληνικά, кириллица.",
    "日本語のテキストと中文文本，还有한국어.",
    "Emoji: 😀👍🏽 🇫🇷 👨‍👩‍👧 ❤️ 🦀!",
    "Mixed 😀日本é\n\tdef f(x): return '🎉' * x",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_dir)


def _stream(
    tokenizer: Tokenizer,
    ids: list[int],
    chunk: int = 1,
    prompt: list[int] | None = None,
    skip_special_tokens: bool = True,
) -> tuple[list[str], IncrementalDetokenizer]:
    detokenizer = IncrementalDetokenizer(
        tokenizer, prompt or [], skip_special_tokens=skip_special_tokens
    )
    deltas = [detokenizer.step(ids[start : start + chunk]) for start in range(0, len(ids), chunk)]
    return deltas, detokenizer


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_concatenate_to_full_decode(tokenizer: Tokenizer, text: str, chunk: int):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, detokenizer = _stream(tokenizer, ids, chunk)
    full = tokenizer.decode(ids)
    assert full == text
    assert "".join(deltas) == full
    assert detokenizer.text == full
    assert all("\ufffd" not in delta for delta in deltas)
    emitted = ""
    for delta in deltas:  # every intermediate text is a prefix of the final one
        emitted += delta
        assert full.startswith(emitted)


def test_partial_characters_are_held_back(tokenizer: Tokenizer):
    # Byte-level BPE splits this emoji over several tokens that are not valid UTF-8 alone.
    ids = tokenizer.encode("🦀", add_special_tokens=False)
    assert len(ids) > 1 and "\ufffd" in tokenizer.decode(ids[:1])
    deltas, _ = _stream(tokenizer, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "🦀"


def test_flush_releases_an_unfinished_character(tokenizer: Tokenizer):
    ids = tokenizer.encode("ok 🦀", add_special_tokens=False)[:-1]  # cut inside the emoji
    deltas, detokenizer = _stream(tokenizer, ids)
    assert "\ufffd" not in "".join(deltas)
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == tokenizer.decode(ids) == detokenizer.text
    assert detokenizer.text.endswith("\ufffd")


def test_prompt_does_not_leak_into_text(tokenizer: Tokenizer):
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hi 😀"}]))
    generated = tokenizer.encode("Hello! ¿Qué tal? 你好", add_special_tokens=False)
    deltas, detokenizer = _stream(tokenizer, generated, prompt=prompt)
    assert "".join(deltas) == detokenizer.text == "Hello! ¿Qué tal? 你好"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_in_stream(tokenizer: Tokenizer, skip_special_tokens: bool):
    text = "<|im_start|>assistant\nSí, 東京 😀<|im_end|>\n<|endoftext|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.token_to_id("<|im_end|>") in ids
    deltas, detokenizer = _stream(tokenizer, ids, skip_special_tokens=skip_special_tokens)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == detokenizer.text == expected
    if skip_special_tokens:
        assert expected == "assistant\nSí, 東京 😀\n"
    else:
        assert expected == text


def test_decode_window_stays_small(tokenizer: Tokenizer):
    calls: list[int] = []
    original_decode = tokenizer.decode

    class CountingTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return original_decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer.encode(" ".join(TEXTS) * 8, add_special_tokens=False)
    assert len(ids) > 500
    detokenizer = IncrementalDetokenizer(CountingTokenizer(), [])
    for token_id in ids:
        detokenizer.step([token_id])
    assert detokenizer.text == tokenizer.decode(ids)
    assert max(calls) <= 12


def test_convert_ids_to_tokens(tokenizer: Tokenizer):
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert tokenizer.convert_ids_to_tokens(0) == "<|endoftext|>"


def test_chat_template_text_parts_and_errors(tokenizer: Tokenizer):
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}],
        }
    ]
    assert tokenizer.apply_chat_template(parts).endswith(
        "<|im_start|>user\nfirst\nsecond<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="image_url"):
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ChatTemplateError, match="not allowed"):
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}],
            chat_template="{{ raise_exception('role not allowed') }}",
        )
    custom = (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] | upper }}{% endfor %}{{ extra }}"
    )
    assert (
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hé"}], chat_template=custom, extra="!"
        )
        == "<|im_start|>HÉ!"
    )


def test_missing_chat_template_is_a_clear_error(
    tokenizer: Tokenizer, smollm2_dir: Path, tmp_path: Path
):
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    bare = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert (
        Tokenizer.from_pretrained(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])
        == "hi"
    )


def test_missing_tokenizer_json_is_a_clear_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_add_bos_token_and_eos_lists(smollm2_dir: Path, tmp_path: Path):
    """Generic HF dirs: BOS from the config or from the tokenizer.json post-processor, never twice."""
    transformers = pytest.importorskip("transformers")
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    with_bos = Tokenizer.from_pretrained(tmp_path)
    assert with_bos.encode("hi there") == [1] + with_bos.encode(
        "hi there", add_special_tokens=False
    )
    assert with_bos.eos_token_ids == {0, 2}
    assert with_bos.eos_token_id == 2

    # Llama 3 style: the post-processor adds BOS itself.
    backend = BackendTokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    post_processed = Tokenizer.from_pretrained(tmp_path)
    ids = post_processed.encode("hi there")
    assert ids[0] == 1 and ids[1] != 1
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert reference("hi there")["input_ids"] == ids


def test_encode_each_gives_encodes_ids(tokenizer: Tokenizer):
    """The prompt-list path (one GIL-free encode_batch call per text) gives what `encode` gives,
    short texts and long ones, with and without special tokens."""
    texts = ["hello", "", "The quick brown fox jumps. " * 400, "é\n\t<|im_end|> x"]
    for special in (True, False):
        assert tokenizer.encode_each(texts, special) == [
            tokenizer.encode(t, special) for t in texts
        ]


def test_assistant_call_without_text_and_its_reasoning_reach_the_template(tokenizer: Tokenizer):
    """As gpt-oss's template reads an assistant turn with a tool call: `"x" in message.content`
    (a call without text has content "", not None, as vLLM renders it) and the reasoning as
    `thinking` (sent back as reasoning_content or reasoning)."""
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}"
        "{% if 'content' in m and '<|channel|>' in m.content %}{{ raise_exception('tags') }}{% endif %}"
        "[{{ m.thinking }}|{{ m.content }}|{{ m.tool_calls[0].function.arguments | tojson }}]"
        "{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    for field in ("reasoning_content", "reasoning"):
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, field: "think", "tool_calls": [call]},
        ]
        assert (
            tokenizer.apply_chat_template(messages, chat_template=template) == 'hi[think||{"a": 1}]'
        )
    # An explicit thinking field is kept; other roles and plain assistant turns are untouched.
    messages = [
        {
            "role": "assistant",
            "content": "x",
            "thinking": "mine",
            "reasoning_content": "other",
            "tool_calls": [call],
        }
    ]
    assert tokenizer.apply_chat_template(messages, chat_template=template) == '[mine|x|{"a": 1}]'
