"""The tokenizer of a GGUF file, rebuilt as a `tokenizers` tokenizer (tokenizer.json) with its
tokenizer_config.json, from the `tokenizer.ggml.*` metadata llama.cpp's converters write: a
byte-level BPE (`gpt2`: Llama 3, Qwen, SmolLM, gpt-oss) or a SentencePiece BPE (`llama`: Llama 2,
Mistral 7B and their kind, whose vocabulary comes with a score a piece and no merges)."""

from __future__ import annotations

import itertools

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from nanoserve.models.gguf.reader import GGUFImportError

# llama.cpp's `tokenizer.ggml.pre` names the pre-tokenizer regex the vocabulary was trained with.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = {"gpt2", "default", "mpt", "olmo", "jais"}
_DIGITS_THEN_GPT2_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"}
_LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"}
# Qwen2's: Llama 3's with each digit alone (\p{N} for \p{N}{1,3}); its Hugging Face tokenizer
# also puts the text in NFC first.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN2_PRE = {"qwen2"}
# GPT-4o's (tiktoken's o200k_base; gpt-oss): words with their case runs and contractions, digits in
# threes, punctuation runs with trailing newlines or slashes, then whitespace as GPT-2's.
_LETTERS_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LETTERS_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = "|".join(
    [
        rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}*{_LETTERS_LOWER}+{_CONTRACTIONS}",
        rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}+{_LETTERS_LOWER}*{_CONTRACTIONS}",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
_GPT4O_PRE = {"gpt-4o"}
# Pre-tokenizers that split by a regex before the byte-level mapping: the regex of each.
_SPLIT_PRE = {
    **{pre: _LLAMA3_SPLIT for pre in _LLAMA3_PRE},
    **{pre: _QWEN2_SPLIT for pre in _QWEN2_PRE},
    **{pre: _GPT4O_SPLIT for pre in _GPT4O_PRE},
}

_TOKEN_TYPE_NORMAL = 1
_TOKEN_TYPE_UNKNOWN = 2
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_TOKEN_TYPE_BYTE = 6
_SPM_SPACE = "\u2581"  # SentencePiece's visible space, "▁"


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte → printable character table."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(pre: str):
    if pre in _DIGITS_THEN_GPT2_PRE:
        # llama.cpp: "\p{N}" (each digit alone), then GPT-2's regex.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(
                    add_prefix_space=False, trim_offsets=True, use_regex=False
                ),
            ]
        )
    raise GGUFImportError(f"GGUF pre-tokenizer {pre!r} is not supported")


def spm_merges(
    tokens: list[str], scores: list[float], token_types: list[int]
) -> list[tuple[str, str]]:
    """A SentencePiece BPE vocabulary as BPE merges. SentencePiece merges, among adjacent pieces,
    the pair whose union is the highest-scoring normal piece of the vocabulary (control, byte,
    unused and user-defined pieces are never formed by merging); a BPE merge list ranked by that
    score does the same. Every way to cut such a piece into two normal pieces is a merge of its
    rank (the cuts of one piece in the order of their left part's id)."""
    mergeable = {
        token: index
        for index, (token, kind) in enumerate(zip(tokens, token_types))
        if kind == _TOKEN_TYPE_NORMAL
    }
    # Each cut is looked up by the rolling hashes of its two sides, kept as the cut moves, so a
    # piece costs its length in time and nothing in memory, not its length squared (slicing
    # every cut of a 10^5-character piece took minutes).
    by_hash: dict[tuple[int, int], list[str]] = {}
    for piece in mergeable:
        by_hash.setdefault((len(piece), _hash(piece)), []).append(piece)
    ranked = []
    for piece, index in mergeable.items():
        length, whole = len(piece), _hash(piece)
        prefix, scale = 0, pow(_HASH_BASE, length, _HASH_MODULUS)  # scale: BASE^(length - cut)
        for cut, code in enumerate(itertools.islice(map(ord, piece), length - 1), 1):
            prefix = (prefix * _HASH_BASE + code) % _HASH_MODULUS
            scale = scale * _HASH_BASE_INVERSE % _HASH_MODULUS
            lefts = by_hash.get((cut, prefix))
            rights = lefts and by_hash.get((length - cut, (whole - prefix * scale) % _HASH_MODULUS))
            if rights:  # equal hashes: the sides themselves compared (a collision is possible)
                left = next((token for token in lefts if piece.startswith(token)), None)
                right = next((token for token in rights if piece.endswith(token)), None)
                if left is not None and right is not None:
                    ranked.append(
                        (-scores[index], index, mergeable[left], mergeable[right], left, right)
                    )
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


_HASH_MODULUS = (1 << 61) - 1  # a prime: polynomial hashes of distinct strings rarely meet
_HASH_BASE = 1_000_003
_HASH_BASE_INVERSE = pow(_HASH_BASE, -1, _HASH_MODULUS)


def _hash(text: str) -> int:
    """The polynomial hash of `text`: that of text[:cut] is that of its last character plus BASE
    times that of text[:cut - 1]; that of text[cut:] is hash(text) - hash(text[:cut]) *
    BASE^(len(text) - cut), modulo the modulus."""
    value = 0
    for code in map(ord, text):
        value = (value * _HASH_BASE + code) % _HASH_MODULUS
    return value


def _bpe(**options) -> BackendTokenizer:
    """tokenizers' BPE model over the file's vocabulary and merges (GGUFImportError, one line, where
    they do not make one: a merge of a token the vocabulary lacks)."""
    try:
        return BackendTokenizer(models.BPE(**options))
    except Exception as error:  # tokenizers raises a plain Exception
        reason = " ".join(str(error).split())[:200]
        raise GGUFImportError(f"GGUF vocabulary does not make a BPE tokenizer: {reason}") from None


def _spm_tokenizer(metadata: dict, tokens: list[str], token_types: list[int]) -> BackendTokenizer:
    """llama.cpp's `llama` (SentencePiece BPE) tokenizer: spaces as ▁ and one before the text
    (`tokenizer.ggml.add_space_prefix`, default on), the pieces merged by score, characters outside
    the vocabulary as their UTF-8 bytes' <0xXX> pieces where the vocabulary has them (byte
    fallback), else the unknown piece."""
    scores = metadata.get("tokenizer.ggml.scores")
    if not scores or len(scores) != len(tokens):
        raise GGUFImportError(
            "GGUF SentencePiece tokenizer ('llama') lacks tokenizer.ggml.scores for its tokens"
        )
    unknown = next(
        (token for token, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_UNKNOWN), None
    )
    byte_fallback = _TOKEN_TYPE_BYTE in token_types
    tokenizer = _bpe(
        vocab={token: index for index, token in enumerate(tokens)},
        merges=spm_merges(tokens, scores, token_types),
        unk_token=unknown,
        fuse_unk=True,
        byte_fallback=byte_fallback,
        dropout=None,
    )
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", _SPM_SPACE)
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), replace]) if prefix else replace
    )
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tokenizer


# The vocabulary's arrays and the kind of element each holds (tokens required).
_ARRAY_KINDS = {
    "tokenizer.ggml.tokens": (str,),
    "tokenizer.ggml.merges": (str,),
    "tokenizer.ggml.token_type": (int,),
    "tokenizer.ggml.scores": (int, float),
}


def _check_arrays(metadata: dict) -> None:
    """Each vocabulary array is a list of its kind of element (GGUFImportError, one line, else)."""
    if "tokenizer.ggml.tokens" not in metadata:
        raise GGUFImportError("GGUF metadata lacks tokenizer.ggml.tokens")
    for key, kinds in _ARRAY_KINDS.items():
        value = metadata.get(key, [])
        if not isinstance(value, list) or not all(isinstance(item, kinds) for item in value):
            raise GGUFImportError(
                f"GGUF metadata {key} is not an array of {' or '.join(k.__name__ for k in kinds)}"
            )


def build_tokenizer(metadata: dict, model_max_length: int) -> tuple[BackendTokenizer, dict]:
    model = metadata.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise GGUFImportError(
            f"GGUF tokenizer model {model!r} is not supported (byte-level BPE, 'gpt2', and "
            "SentencePiece BPE, 'llama')"
        )
    _check_arrays(metadata)
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if model == "llama":
        # With the space prefix, tokenizers would prepend ▁ to the added tokens' own text as well,
        # so a user-defined run of spaces is only matched without it (Gemma's case).
        prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        return _finish(
            _spm_tokenizer(metadata, tokens, token_types),
            metadata,
            tokens,
            token_types,
            model_max_length,
            spelled=set(tokens),
            spaced=None if prefix else _SPM_SPACE,
        )
    merges = [tuple(merge.split(" ")) for merge in metadata.get("tokenizer.ggml.merges", [])]
    if any(len(merge) != 2 for merge in merges):
        raise GGUFImportError("malformed entry in tokenizer.ggml.merges")

    alphabet = _byte_level_alphabet()
    spelling = set(alphabet.values())
    # llama.cpp sometimes stores a token in plain UTF-8; BPE needs it in the byte alphabet.
    vocab = {
        token if set(token) <= spelling else "".join(alphabet[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    tokenizer = _bpe(
        vocab=vocab,
        merges=merges,
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    if pre in _QWEN2_PRE:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return _finish(
        tokenizer,
        metadata,
        tokens,
        token_types,
        model_max_length,
        spelled={token for token in tokens if set(token) <= spelling},
    )


def _finish(
    tokenizer: BackendTokenizer,
    metadata: dict,
    tokens: list[str],
    token_types: list[int],
    model_max_length: int,
    spelled: set[str],
    spaced: str | None = None,
) -> tuple[BackendTokenizer, dict]:
    """The control and user-defined tokens as added tokens, and tokenizer_config.json. `spelled`:
    the tokens the model's vocabulary holds as they are written; `spaced`: SentencePiece's space
    mark, which a user-defined token (a run of spaces, as Gemma's) holds where the text has spaces:
    such a token is matched in the normalized text, the others in the text as written."""
    # Matched whole in text, never split by BPE. A "control" token outside the byte alphabet would
    # not map back to its id, so it is left out, as llama.cpp's converters do.
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, token_types)
            if kind == _TOKEN_TYPE_CONTROL and token in spelled
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=spaced is not None and spaced in token)
            for token, kind in zip(tokens, token_types)
            if kind == _TOKEN_TYPE_USER_DEFINED
        ]
    )
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise GGUFImportError("rebuilt tokenizer does not have the GGUF vocabulary's size")

    def token_of(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token_of("bos_token_id"),
        "eos_token": token_of("eos_token_id"),
        "pad_token": token_of("padding_token_id"),
        "unk_token": token_of("unknown_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if metadata.get("tokenizer.chat_template"):
        tokenizer_config["chat_template"] = metadata["tokenizer.chat_template"]
    return tokenizer, tokenizer_config
