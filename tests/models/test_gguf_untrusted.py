"""GGUF files from untrusted hands (issue 52 rows 7 and 8): every count and length in the header is
checked against the bytes left before anything is read (models/gguf/header.py), so a malformed
file is one GGUFImportError line, never a raw exception, a spin or a memory blow-up; and the
SentencePiece merges cost a piece's length, not its square. Oracles: the gguf package's own
reader on well-formed files, the plain every-cut merge construction on small vocabularies. Files
that could make a reader spin are read in a child process under an address-space limit."""

from __future__ import annotations

import collections
import itertools
import json
import resource
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.models.gguf.header import VOCABULARY_ARRAYS, read_gguf_header
from nanoserve.models.gguf.model import (
    gguf_hf_config,
    gguf_metadata,
    gguf_tokenizer,
    read_gguf_file,
)
from nanoserve.models.gguf.reader import GGUFImportError, llama_config, read_metadata
from nanoserve.models.gguf.tokenizer import build_tokenizer, spm_merges

ROOT = Path(__file__).resolve().parents[2]
MEMORY_HEADROOM = 1 << 30  # address space a child may add to what its imports took
FUZZ_EXAMPLES = 2500
ONE_LINE, LOADED = "one-line error", "loaded"
UINT8, UINT32, STRING, ARRAY = 0, 4, 8, 9


# ------------------------------------------------------------------------------ files by hand


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _key_value(key: bytes, kind: int, payload: bytes) -> bytes:
    return _string(key) + struct.pack("<I", kind) + payload


def _gguf(*key_values: bytes, tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, len(key_values)) + b"".join(key_values)


# The file: one uint8 array whose count is 2^62, then the end of the file: 73 bytes.
HUGE_ARRAY = _gguf(
    _key_value(b"tokenizer.ggml.token_type", ARRAY, struct.pack("<IQ", UINT8, 1 << 62))
)


def write_all_types(path: Path) -> Path:
    """A GGUF file with every value type, arrays of numbers and strings, and tensors of float and
    block types in 1 to 3 dims, written by the gguf package's writer."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, key, value in [
        (writer.add_uint8, "u8", 200),
        (writer.add_int8, "i8", -100),
        (writer.add_uint16, "u16", 60000),
        (writer.add_int16, "i16", -30000),
        (writer.add_uint32, "u32", 4_000_000_000),
        (writer.add_int32, "i32", -2_000_000_000),
        (writer.add_float32, "f32", 0.1),
        (writer.add_uint64, "u64", 1 << 63),
        (writer.add_int64, "i64", -(1 << 62)),
        (writer.add_float64, "f64", 0.1),
        (writer.add_bool, "bool", True),
        (writer.add_string, "str", "naïve ▁日本 🙂"),
        (writer.add_array, "ints", [1, -2, 3]),
        (writer.add_array, "floats", [0.5, -1.25]),
        (writer.add_array, "strings", ["a", "", "ü▁"]),
    ]:
        add(f"test.{key}", value)
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.standard_normal((3, 32), dtype=np.float32))
    writer.add_tensor("b.weight", rng.standard_normal((2, 2, 64)).astype(np.float16))
    writer.add_tensor("c.weight", rng.standard_normal(7, dtype=np.float32))
    values = rng.standard_normal((4, 64), dtype=np.float32)
    writer.add_tensor(
        "d.weight",
        gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_sentencepiece_llama(path: Path) -> Path:
    """A one-layer "llama" file with a SentencePiece vocabulary (llama.cpp's tokenizer model
    "llama": scores, token types, byte pieces), as its converter writes one."""
    tokens = [
        "<unk>",
        "<s>",
        "</s>",
        "<0x41>",
        "<0xC3>",
        "▁",
        "a",
        "b",
        "é",
        "▁a",
        "ab",
        "▁ab",
        "▁é",
    ]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(
        [0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0]
    )
    writer.add_token_types([2, 3, 3, 6, 6, 1, 1, 1, 1, 1, 1, 1, 1])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    rng = np.random.default_rng(1)
    writer.add_tensor("token_embd.weight", rng.standard_normal((len(tokens), 32), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", rng.standard_normal((32, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    """Real headers: the tests' own writers' (a llama.cpp Q4_K_M mix with a byte-level BPE
    vocabulary, a Qwen2 file with biases), a SentencePiece vocabulary, every value type."""
    from tests.gguf_models import write_quantized_gguf

    return [
        write_quantized_gguf(tmp_path_factory.mktemp("q4_k_m"), "llama_cpp_q4_k_m", seed=3),
        write_quantized_gguf(tmp_path_factory.mktemp("qwen2"), "q8_0", seed=3, arch="qwen2"),
        write_sentencepiece_llama(tmp_path_factory.mktemp("spm") / "spm.gguf"),
        write_all_types(tmp_path_factory.mktemp("types") / "types.gguf"),
    ]


# ------------------------------------------------------------------ the child process's side


def _limit_memory() -> None:
    """The address space this process has now, plus MEMORY_HEADROOM, as its limit."""
    pages = int(Path("/proc/self/statm").read_text().split()[0])
    soft = pages * resource.getpagesize() + MEMORY_HEADROOM
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(
        resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard)
    )


def _outcome(path: Path) -> str:
    """LOADED, ONE_LINE, or what else happened, through the loader's header and metadata reads
    (all of the file, the engine's cached read that skips the vocabulary, the config and the
    tokenizer from them)."""
    try:
        read_gguf_file(path)
        gguf_metadata(path)
        gguf_hf_config(path)
        gguf_tokenizer(path)
    except GGUFImportError as error:
        message = str(error)
        return (
            ONE_LINE
            if message and "\n" not in message
            else f"a GGUFImportError of lines: {message!r}"
        )
    except (
        BaseException
    ) as error:  # MemoryError, IndexError, UnicodeDecodeError: what must not happen
        return f"{type(error).__name__}: {error}"[:300]
    return LOADED


def _count_fields(path: Path) -> list[tuple[int, int]]:
    """(offset, size) of every unsigned field of the file's header (counts, lengths, types, dims,
    offsets), found by the gguf package's reader on the well-formed file."""
    reader = gguf.GGUFReader(path)
    base = reader.data.ctypes.data
    fields = []
    for field in [*reader.fields.values(), *(tensor.field for tensor in reader.tensors)]:
        for part in field.parts:
            if part.dtype.kind == "u" and part.dtype.itemsize in (4, 8):
                start = part.ctypes.data - base
                fields += [
                    (start + index * part.dtype.itemsize, part.dtype.itemsize)
                    for index in range(part.size)
                ]
    return fields


_SPLICED = [1 << 62, (1 << 64) - 1, (1 << 63) + 1, (1 << 32) - 1, 1 << 31, 1 << 20, 0, 1, 5, 13]


def _fuzz(scratch: Path, corpus: list[Path]) -> dict[str, int]:
    """FUZZ_EXAMPLES mutated files (bit flips in the header, truncations, values spliced into its
    count fields), hypothesis drawing them from a fixed seed; each must load or be one line."""
    sources = [
        (
            path.read_bytes(),
            _count_fields(path),
            min(
                (int(t.data_offset) for t in gguf.GGUFReader(path).tensors),
                default=path.stat().st_size,
            ),
        )
        for path in corpus
    ]
    outcomes: collections.Counter = collections.Counter()
    names = itertools.count()

    @settings(
        max_examples=FUZZ_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def check(data):
        blob, fields, header_end = sources[data.draw(st.integers(0, len(sources) - 1))]
        blob = bytearray(blob)
        for _ in range(data.draw(st.integers(1, 3))):
            if not blob:
                break
            kind = data.draw(st.sampled_from(["flip", "truncate", "splice"]))
            if kind == "flip":
                position = data.draw(st.integers(0, min(header_end, len(blob)) - 1))
                blob[position] ^= 1 << data.draw(st.integers(0, 7))
            elif kind == "truncate":
                del blob[data.draw(st.integers(0, len(blob) - 1)) :]
            else:
                offset, size = data.draw(st.sampled_from(fields))
                value = data.draw(
                    st.one_of(st.sampled_from(_SPLICED), st.integers(0, (1 << 8 * size) - 1))
                )
                if offset + size <= len(blob):
                    blob[offset : offset + size] = (value % (1 << 8 * size)).to_bytes(
                        size, "little"
                    )
        path = scratch / f"mutated-{next(names)}.gguf"  # a new name: gguf_metadata caches by file
        path.write_bytes(bytes(blob))
        outcome = _outcome(path)
        path.unlink()
        outcomes[outcome] += 1
        assert outcome in (LOADED, ONE_LINE), outcome

    check()
    return dict(outcomes)


def child_main(arguments: list[str]) -> None:
    """`load PATH...`: each file's outcome; `fuzz SCRATCH PATH...`: the fuzz's outcome counts.
    One JSON line on stdout, under the address-space limit."""
    mode, *rest = arguments
    _limit_memory()
    if mode == "load":
        print(json.dumps([_outcome(Path(path)) for path in rest]))
    else:
        print(json.dumps(_fuzz(Path(rest[0]), [Path(path) for path in rest[1:]])))


def _run_limited(*arguments: str):
    """child_main in a fresh interpreter; a spin that outlives the timeout fails the test too."""
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
        "from tests.models.test_gguf_untrusted import child_main; child_main(sys.argv[1:])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, *arguments],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=540,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    return json.loads(result.stdout.splitlines()[-1])


# ---------------------------------------------------------------------------------- the rows


def test_a_huge_array_count_is_one_line_not_a_spin(tmp_path):
    """Row 7: the 73-byte file. The count is checked against the bytes left before the array is
    read: one line, at once, in a process that may not grow by a GiB."""
    path = tmp_path / "huge.gguf"
    path.write_bytes(HUGE_ARRAY)
    assert len(HUGE_ARRAY) == 73
    assert _run_limited("load", str(path)) == [ONE_LINE]
    with pytest.raises(
        GGUFImportError, match=r"element count 4611686018427387904 does not fit in the 0 bytes"
    ):
        read_gguf_file(path)


MALFORMED = {
    "truncated scalar": (
        _gguf(_key_value(b"llama.block_count", UINT32, b"\x01\x00")),
        "llama.block_count's value needs 4 bytes, the file has 2 left",
    ),
    "invalid UTF-8 value": (
        _gguf(_key_value(b"general.name", STRING, _string(b"caf\xc3"))),
        "general.name's value is not UTF-8",
    ),
    "invalid UTF-8 key": (
        _gguf(_key_value(b"general.\xffname", STRING, _string(b"x"))),
        "a metadata key is not UTF-8",
    ),
    "string past the end": (
        _gguf(_key_value(b"general.name", STRING, struct.pack("<Q", 1 << 40) + b"abc")),
        "general.name's value needs 1099511627776 bytes, the file has 3 left",
    ),
    "tensor count past the end": (
        _gguf(tensors=1 << 60),
        "tensor count 1152921504606846976 does not fit",
    ),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_header_is_one_line(tmp_path, name):
    """Row 8: a truncated scalar, invalid UTF-8 in a key or a value, a length or count past the
    end: the one-line error through both reads of the file, never IndexError or
    UnicodeDecodeError."""
    blob, match = MALFORMED[name]
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob)
    for read in (read_gguf_file, gguf_metadata):
        with pytest.raises(GGUFImportError, match=match) as raised:
            read(path)
        assert "\n" not in str(raised.value) and str(path) in str(raised.value)


def test_a_vocabulary_token_in_invalid_utf8_is_one_line(tmp_path):
    """The tokenizer's read decodes the vocabulary (the engine's cached read only walks it)."""
    path = tmp_path / "bad.gguf"
    tokens = struct.pack("<IQ", STRING, 2) + _string(b"a") + _string(b"\xe2\x96")
    path.write_bytes(_gguf(_key_value(b"tokenizer.ggml.tokens", ARRAY, tokens)))
    with pytest.raises(GGUFImportError, match=r"tokenizer.ggml.tokens\[1\] is not UTF-8"):
        read_gguf_file(path)
    assert gguf_metadata(path)[0] == {}


def test_tensor_entries_are_checked(tmp_path):
    """A tensor's dims, type, alignment and bytes are checked against the file as llama.cpp does."""

    def tensor(name: bytes, dims: tuple[int, ...], kind: int, offset: int) -> bytes:
        return _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, kind, offset)

    cases = {
        "has 5 dims": tensor(b"t", (32, 1, 1, 1, 1), 0, 0),
        "has unknown tensor type 99": tensor(b"t", (32,), 99, 0),
        "not whole Q8_0 blocks of 32": tensor(b"t", (31,), 8, 0),
        "not a multiple of the alignment 32": tensor(b"t", (32,), 0, 4),
        "run past the end of the file": tensor(b"t", (1 << 40, 1 << 20), 0, 0),
        "has an empty dim": tensor(b"t", (32, 0), 0, 0),
    }
    for match, entry in cases.items():
        path = tmp_path / "tensor.gguf"
        path.write_bytes(_gguf(tensors=1) + entry + bytes(64))
        with pytest.raises(GGUFImportError, match=match):
            read_gguf_file(path)


GEMMA2 = {
    "general.architecture": "gemma2",
    "gemma2.context_length": 512,
    "gemma2.embedding_length": 64,
    "gemma2.block_count": 2,
    "gemma2.feed_forward_length": 128,
    "gemma2.attention.head_count": 4,
    "gemma2.attention.head_count_kv": 2,
    "gemma2.attention.layer_norm_rms_epsilon": 1e-6,
    "gemma2.attention.sliding_window": 16,
    "gemma2.attn_logit_softcapping": 50.0,
    "gemma2.final_logit_softcapping": 30.0,
    "tokenizer.ggml.bos_token_id": 2,
}
GEMMA2_TENSORS = {
    "token_embd.weight",
    "output_norm.weight",
    "blk.0.attn_q.weight",
    "blk.1.attn_q.weight",
}


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("gemma2.attention.head_count", 0, "head_count is '0', not a positive whole number"),
        ("gemma2.block_count", "2", "block_count is '2', not a positive whole number"),
        (
            "gemma2.block_count",
            10**6,
            "block_count 1000000 is more layers than the file's 4 tensors hold",
        ),
        ("gemma2.attention.layer_norm_rms_epsilon", "x", "epsilon is 'x', not a number"),
        (
            "gemma2.attention.sliding_window",
            [16],
            r"sliding_window is '\[16\]', not a whole number",
        ),
        ("tokenizer.ggml.bos_token_id", 2.5, "bos_token_id is '2.5', not a token id"),
    ],
)
def test_a_hyperparameter_of_the_wrong_kind_is_one_line(key, value, match):
    """A value whose type or size a changed bit made wrong: one line naming the key, not a
    ZeroDivisionError, a TypeError or a list of a million layer types."""
    assert llama_config(GEMMA2, GEMMA2_TENSORS, "m.gguf")["num_hidden_layers"] == 2
    with pytest.raises(GGUFImportError, match=match):
        llama_config({**GEMMA2, key: value}, GEMMA2_TENSORS, "m.gguf")


@pytest.mark.parametrize(
    "key, value",
    [
        ("tokenizer.ggml.tokens", [1, 2]),
        ("tokenizer.ggml.token_type", ["1"]),
        ("tokenizer.ggml.scores", "x"),
        ("tokenizer.ggml.merges", [3]),
    ],
)
def test_a_vocabulary_array_of_the_wrong_kind_is_one_line(key, value):
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"], key: value}
    with pytest.raises(GGUFImportError, match=f"{key} is not an array of"):
        build_tokenizer(metadata, 512)


def test_merges_of_tokens_the_vocabulary_lacks_are_one_line():
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b", "a )"],
    }
    with pytest.raises(GGUFImportError, match="does not make a BPE tokenizer: .*out of vocabulary"):
        build_tokenizer(metadata, 512)


def test_the_corpus_files_load(corpus):
    """Every corpus file but the value-type one (no hyperparameters) loads whole: the fuzz starts
    from files the loader takes."""
    assert [_outcome(path) for path in corpus[:-1]] == [LOADED] * (len(corpus) - 1)


def test_the_header_equals_the_gguf_packages_reading(corpus):
    """On well-formed files: the same metadata values and tensor entries as the gguf package's
    reader (its GGUF.* pseudo-keys aside), and the skipping read the same less the vocabulary."""
    for path in corpus:
        reader = gguf.GGUFReader(path)
        expected = {
            key: value
            for key, value in read_metadata(reader).items()
            if not key.startswith("GGUF.")
        }
        header = read_gguf_header(path)
        assert header.metadata == expected
        assert [
            (t.name, t.tensor_type, t.shape, t.n_bytes, t.data_offset) for t in header.tensors
        ] == [
            (
                t.name,
                t.tensor_type,
                tuple(int(d) for d in t.shape),
                int(t.n_bytes),
                int(t.data_offset),
            )
            for t in reader.tensors
        ]
        skipping = read_gguf_header(path, skip=VOCABULARY_ARRAYS)
        assert skipping.metadata == {
            k: v for k, v in expected.items() if k not in VOCABULARY_ARRAYS
        }
        assert skipping.array_lengths == header.array_lengths
        assert skipping.tensors == header.tensors


def test_mutated_headers_load_or_are_one_line(corpus, tmp_path):
    """The fuzz: a few thousand mutations of real headers, each read in full under a memory limit;
    both outcomes occur (the mutations reach past the first bytes)."""
    outcomes = _run_limited("fuzz", str(tmp_path), *map(str, corpus))
    assert set(outcomes) <= {LOADED, ONE_LINE}, outcomes
    assert sum(outcomes.values()) >= FUZZ_EXAMPLES * 0.9  # (hypothesis may skip a few duplicates)
    assert outcomes.get(ONE_LINE, 0) >= FUZZ_EXAMPLES // 4 and outcomes.get(LOADED, 0) >= 50, (
        outcomes
    )


# ------------------------------------------------------------------- SentencePiece merges


def every_cut_merges(
    tokens: list[str], scores: list[float], token_types: list[int]
) -> list[tuple[str, str]]:
    """The oracle: every cut of every normal piece sliced and looked up."""
    mergeable = {
        token: index for index, (token, kind) in enumerate(zip(tokens, token_types)) if kind == 1
    }
    ranked = []
    for piece, index in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append(
                    (-scores[index], index, mergeable[left], mergeable[right], left, right)
                )
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


@settings(max_examples=300, deadline=None)
@given(
    vocabulary=st.lists(
        st.tuples(
            st.text("ab▁é", min_size=1, max_size=7),
            st.integers(-8, 0),
            st.sampled_from([1, 1, 1, 2, 3, 6]),
        ),
        max_size=40,
    )
)
def test_merges_equal_every_cut(vocabulary):
    tokens = [token for token, _, _ in vocabulary]
    scores = [float(score) for _, score, _ in vocabulary]
    types = [kind for _, _, kind in vocabulary]
    assert spm_merges(tokens, scores, types) == every_cut_merges(tokens, scores, types)


class _Counted(str):
    """A piece that counts the characters every str operation on it reads or makes."""

    work = 0

    def _add(self, amount: int) -> None:
        type(self).work += amount + 1

    def __getitem__(self, key):
        result = str.__getitem__(self, key)
        self._add(len(result))
        return result

    def __iter__(self):
        self._add(len(self))
        return str.__iter__(self)

    def __hash__(self):
        self._add(len(self))
        return str.__hash__(self)

    def __eq__(self, other):
        self._add(len(self))
        return str.__eq__(self, other)

    def startswith(self, prefix, *args):
        self._add(len(prefix))
        return str.startswith(self, prefix, *args)

    def endswith(self, suffix, *args):
        self._add(len(suffix))
        return str.endswith(self, suffix, *args)


def _merge_work(length: int) -> tuple[int, list]:
    """The characters spm_merges touches for a vocabulary with one piece of `length` characters."""
    long_piece = ("ab" * length)[:length]
    tokens = [_Counted(token) for token in ("a", "b", "ab", "ba", long_piece[:-1], long_piece)]
    _Counted.work = 0
    merges = spm_merges(tokens, [0.0, 0.0, -1.0, -2.0, -3.0, -4.0], [1] * len(tokens))
    return _Counted.work, merges


def test_a_long_piece_costs_its_length_not_its_square():
    """Row 8: one very long SentencePiece piece. The work, counted in characters read or made by
    string operations, doubles when the piece's length doubles (every cut sliced: quadruples)."""
    work, merges = _merge_work(4000)
    double, _ = _merge_work(8000)
    assert work >= 4000
    assert double <= 2.5 * work, (work, double)
    long_piece = ("ab" * 4000)[:4000]
    assert (long_piece[:-1], long_piece[-1]) in merges  # the long piece is still formed


def test_a_vocabulary_with_a_long_piece_builds_its_tokenizer():
    """The whole tokenizer of a SentencePiece vocabulary with a 20,000-character piece, merged
    from its two parts: encoding the piece's text gives its id, and its id decodes to the text."""
    long_piece = "▁" + "ab" * 10_000
    tokens = ["<unk>", "<s>", "</s>", "▁", "a", "b", long_piece[:-1], long_piece]
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0],
        "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1, 1, 1],
    }
    backend, _ = build_tokenizer(metadata, 512)
    assert backend.decode([len(tokens) - 1]) == long_piece[1:]
