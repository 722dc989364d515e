"""GGUF files whose vocabulary is SentencePiece BPE (llama.cpp's tokenizer model "llama": Llama 2,
Mistral 7B, ...: pieces with scores, no merges), rebuilt by models/gguf/tokenizer.py. Oracle: the
`sentencepiece` package itself, on a model it trains here (byte fallback, digits split, identity
normalization, as Llama 2's) and writes into the metadata the way llama.cpp's converter does."""

from __future__ import annotations

import io
from pathlib import Path

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.models.gguf.reader import read_metadata
from nanoserve.models.gguf.tokenizer import build_tokenizer
from nanoserve.tokenizer import Tokenizer

spm = pytest.importorskip("sentencepiece")

CORPUS = Path(__file__).resolve().parents[2] / "benchmarks/quant/perplexity_text.txt"
TEXTS = [
    "Hello world",
    "The import system  has   three spaces",
    "x = 12345 + 67.5",
    "naïve café 日本語 🙂",
    "\n\ndef f(a, b):\n    return a+b\n",
    " leading space",
    "trailing space ",
    "",
    "AbCdEf GHI",
    "tabs\tand\u00a0no-break spaces",
]


def train(add_dummy_prefix: bool, user_defined: tuple[str, ...] = ()):
    model = io.BytesIO()
    lines = CORPUS.read_text().splitlines()[:2000]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=800,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        add_dummy_prefix=add_dummy_prefix,
        character_coverage=0.9995,
        minloglevel=2,
        num_threads=1,
        user_defined_symbols=list(user_defined),
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    sp.user_defined = user_defined
    return sp


def gguf_metadata(sp, add_space_prefix: bool) -> dict:
    """The tokenizer.ggml.* fields llama.cpp's converter (_set_vocab_sentencepiece) writes."""
    user_defined = getattr(sp, "user_defined", ())
    types = [
        2
        if sp.is_unknown(i)
        else 3
        if sp.is_control(i)
        else 5
        if sp.is_unused(i)
        else 6
        if sp.is_byte(i)
        else 4
        if sp.id_to_piece(i) in user_defined
        else 1
        for i in range(sp.get_piece_size())
    ]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(len(types))],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(len(types))],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-prefix"])
def pair(request):
    sp = train(request.param)
    backend, config = build_tokenizer(gguf_metadata(sp, request.param), 512)
    return sp, backend, config


def test_encodes_and_decodes_as_sentencepiece(pair):
    sp, backend, _ = pair
    for text in TEXTS + CORPUS.read_text().splitlines()[2000:2300]:
        ids = sp.encode(text)
        assert backend.encode(text, add_special_tokens=False).ids == ids, text
        assert backend.decode(ids) == sp.decode(ids), text


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(st.sampled_from(list("abcdefghij ABC 0123456789.,'\n\t-éü日本🙂")), max_size=40)
)
def test_any_text_encodes_as_sentencepiece(pair, text):
    sp, backend, _ = pair
    assert backend.encode(text, add_special_tokens=False).ids == sp.encode(text)


def test_user_defined_runs_of_spaces_without_the_space_prefix():
    """User-defined pieces holding SentencePiece's ▁ (runs of spaces, a double newline, as Gemma's
    vocabulary has), no space prefix (Gemma's files): matched whole in the normalized text, as
    SentencePiece does. (With the prefix they are left to the merges: tokenizers would prepend ▁
    to their own text.)"""
    sp = train(False, ("\u2581\u2581", "\u2581\u2581\u2581\u2581", "\n\n"))
    backend, _ = build_tokenizer(gguf_metadata(sp, False), 512)
    for text in (
        TEXTS
        + ["a  b", "x    y\n\nz", "   three", "end  "]
        + CORPUS.read_text().splitlines()[2000:2200]
    ):
        assert backend.encode(text, add_special_tokens=False).ids == sp.encode(text), text
    assert sp.piece_to_id("\u2581\u2581") in backend.encode("a  b", add_special_tokens=False).ids


def test_from_a_file_with_bos_and_control_tokens(tmp_path):
    """Through a GGUF file (float scores, the prefix flag) and the engine's Tokenizer: BOS prepended
    as add_bos_token says, <s> and </s> in text matched whole, and the space prefix applied after
    them as llama.cpp does."""
    sp = train(True)
    metadata = gguf_metadata(sp, True)
    writer = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(metadata["tokenizer.ggml.tokens"])
    writer.add_token_scores(metadata["tokenizer.ggml.scores"])
    writer.add_token_types(metadata["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    backend, config = build_tokenizer(read_metadata(gguf.GGUFReader(tmp_path / "vocab.gguf")), 512)
    tokenizer = Tokenizer(backend, config)
    assert tokenizer.encode("Hello world") == [sp.bos_id()] + sp.encode("Hello world")
    assert tokenizer.encode("</s>Hi<s>", add_special_tokens=False) == [sp.eos_id()] + sp.encode(
        "Hi"
    ) + [sp.bos_id()]
    assert tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"


def test_streamed_text_is_the_decoded_text(pair):
    """The engine's incremental detokenizer on SentencePiece ids, one at a time: the deltas add up
    to the whole decode (spaces before words, byte-fallback characters split over several ids
    held back until complete), whatever the first generated id is."""
    from nanoserve.tokenizer import IncrementalDetokenizer

    sp, backend, config = pair
    tokenizer = Tokenizer(backend, config)
    for text in [
        "Hello world, naïve café 日本語 🙂 and  two spaces",
        "x = 12345\n\ndef f():\n    return 1",
    ]:
        ids = sp.encode(text)
        for start in (0, 1, 3):  # the "prompt" ends at `start`; the rest is generated
            detokenizer = IncrementalDetokenizer(tokenizer, ids[:start])
            deltas = [detokenizer.step([token]) for token in ids[start:]] + [detokenizer.flush()]
            assert "\ufffd" not in "".join(deltas)
            assert "".join(deltas) == tokenizer.decode(ids[start:]), (text, start)
