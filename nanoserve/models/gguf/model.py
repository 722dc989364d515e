"""Serving a GGUF file as it is (vLLM's `--model FILE.gguf`): which path is one, the config and
tokenizer its metadata implies, and the `--quantization` it goes with. The weights are loaded by
models/gguf/weights.py, linear layers keeping their quantization blocks."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

import numpy as np

from nanoserve.models.compressed_tensors import (
    QUANT_METHOD,
    checkpoint_quant_method,
    compressed_tensors_config,
)
from nanoserve.models.fp8 import FP8_METHOD, fp8_config
from nanoserve.models.gguf.header import VOCABULARY_ARRAYS, GGUFHeader, read_gguf_header
from nanoserve.models.gguf.reader import ROPE_FACTOR_TENSORS, llama_config, with_rope_factors
from nanoserve.models.gptq_awq import FLAG_ALIASES, GPTQ, group_quant_config
from nanoserve.models.gptq_awq import METHODS as GROUP_METHODS
from nanoserve.models.mxfp4 import MXFP4_METHOD

GGUF_MAGIC = b"GGUF"


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as file:
            return file.read(4) == GGUF_MAGIC
    except OSError:
        return False


def find_gguf_file(path: Path) -> Path | None:
    """The GGUF file `path` stands for: `path` itself when it is one, or the single *.gguf file of a
    directory without a config.json (a Hugging Face directory wins); None otherwise."""
    path = Path(path)
    if path.is_file():
        return path if _is_gguf(path) else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(file for file in path.glob("*.gguf") if file.is_file())
    if len(files) > 1:
        raise ValueError(
            f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); "
            "name one with --model"
        )
    return files[0] if files else None


def _tensor_table(header: GGUFHeader) -> dict[str, tuple]:
    return {tensor.name: (tensor.tensor_type, tensor.shape) for tensor in header.tensors}


def read_gguf_file(gguf_file: Path) -> tuple[dict, dict[str, tuple]]:
    """(metadata, {tensor name: (ggml type, GGUF shape)}), all of it, read now (not cached);
    GGUFImportError, one line, for a malformed file (models/gguf/header.py checks every count)."""
    header = read_gguf_header(gguf_file)
    return header.metadata, _tensor_table(header)


@functools.lru_cache(maxsize=4)
def _read(gguf_file: Path, size: int, mtime: float) -> tuple[dict, dict[str, tuple]]:
    """read_gguf_file without the vocabulary's arrays (checked, not kept; the tokens' count stays
    as the vocabulary size, as llama_config would take it); cached per file version, the engine
    asks for it several times."""
    header = read_gguf_header(gguf_file, skip=VOCABULARY_ARRAYS)
    metadata = dict(header.metadata)
    architecture = metadata.get("general.architecture")
    if "tokenizer.ggml.tokens" in header.array_lengths and isinstance(architecture, str):
        metadata.setdefault(
            f"{architecture}.vocab_size", header.array_lengths["tokenizer.ggml.tokens"]
        )
    return metadata, _tensor_table(header)


def gguf_metadata(gguf_file: Path) -> tuple[dict, dict[str, tuple]]:
    """The file's metadata (less the vocabulary's arrays: gguf_tokenizer reads those) and tensors."""
    stat = Path(gguf_file).stat()
    return _read(Path(gguf_file), stat.st_size, stat.st_mtime)


# Row-parallel layers (their input features split across tensor-parallel ranks).
_ROW_PARALLEL = (".attn_output.weight", ".ffn_down.weight")


def check_gguf_file(gguf_file: Path, tensor_parallel_size: int) -> None:
    """Before any rank loads: every tensor's type is one we multiply (or a float type), and a
    row-parallel layer's inputs split into whole quantization blocks (ValueError, one line)."""
    from nanoserve.kernels import quant

    _, tensors = gguf_metadata(gguf_file)
    for name, (ggml_type, shape) in tensors.items():
        if ggml_type.name in ("F32", "F16", "BF16"):
            continue
        try:
            qtype = quant.qtype_name(ggml_type)
        except ValueError as error:
            raise ValueError(f"{Path(gguf_file).name}: {name}: {error}") from None
        block = quant.gguf_block(qtype)[0]
        k = shape[0]
        if name.endswith(_ROW_PARALLEL) and (
            k % tensor_parallel_size or (k // tensor_parallel_size) % block
        ):
            raise ValueError(
                f"{name} ({qtype.upper()}, blocks of {block} values) cannot split its {k} input features "
                f"across tensor parallel size {tensor_parallel_size} on whole blocks"
            )


def gguf_hf_config(gguf_file: Path) -> dict:
    """The Hugging Face config.json a GGUF file of the Llama family (llama, qwen2) implies."""
    metadata, tensors = gguf_metadata(gguf_file)
    config = llama_config(metadata, set(tensors), Path(gguf_file).name)
    if (
        set(ROPE_FACTOR_TENSORS) <= tensors.keys()
    ):  # Phi-3's LongRoPE factors: two small F32 tensors
        config = with_rope_factors(config, _factor_tensors(Path(gguf_file)))
    return config


class _FactorTensor(NamedTuple):
    name: str
    data: np.ndarray  # float32 values


@functools.lru_cache(maxsize=4)
def _factor_tensors(gguf_file: Path) -> list[_FactorTensor]:
    """Phi-3's LongRoPE factor tensors as float32, read from the checked header's places."""
    import gguf

    factors = []
    for tensor in read_gguf_header(gguf_file, skip=VOCABULARY_ARRAYS).tensors:
        if tensor.name in ROPE_FACTOR_TENSORS:
            raw = np.fromfile(
                gguf_file, dtype=np.uint8, count=tensor.n_bytes, offset=tensor.data_offset
            )
            values = gguf.quants.dequantize(raw, tensor.tensor_type)
            factors.append(
                _FactorTensor(tensor.name, np.asarray(values, dtype=np.float32).reshape(-1))
            )
    return factors


def gguf_tokenizer(gguf_file: Path):
    """The tokenizer and chat template stored in the file's metadata (models/gguf/tokenizer.py)."""
    from nanoserve.models.gguf.tokenizer import build_tokenizer
    from nanoserve.tokenizer import Tokenizer

    metadata, _ = read_gguf_file(Path(gguf_file))
    config = gguf_hf_config(gguf_file)
    backend, tokenizer_config = build_tokenizer(metadata, config["max_position_embeddings"])
    return Tokenizer(
        backend,
        tokenizer_config,
        generation_eos_token_ids=generation_stops(config, backend),
        chat_template=tokenizer_config.get("chat_template"),
    )


# Tokens that end a turn besides the file's eos, per family, where the vocabulary has them: Gemma's
# <end_of_turn>; the harmony format's <|return|> (an answer) and <|call|> (a tool call), as
# gpt-oss's generation_config.json and llama.cpp's end-of-generation tokens have them.
_TURN_ENDS = {
    "Gemma2ForCausalLM": ("<end_of_turn>",),
    "Gemma3ForCausalLM": ("<end_of_turn>",),
    "GptOssForCausalLM": ("<|return|>", "<|call|>", "<|endoftext|>"),
}


def generation_stops(config: dict, backend) -> list[int]:
    """The ids that end generation (generation_config.json's eos_token_id list)."""
    eos = config.get("eos_token_id")
    stops = [] if eos is None else [eos]
    vocab = backend.get_vocab(with_added_tokens=True)
    for token in _TURN_ENDS.get(config["architectures"][0], ()):
        if token in vocab and vocab[token] not in stops:
            stops.append(vocab[token])
    return stops


def check_quantization(quantization: str | None, model: Path) -> None:
    """`--quantization`: "gguf" is implied by a GGUF model, "compressed-tensors", "gptq" (or
    "gptq_marlin"), "awq" (or "awq_marlin"), "fp8" and "mxfp4" (gpt-oss's experts) by a checkpoint
    whose config.json says so (its scheme is checked here, before any rank loads); each means
    nothing for any other model, and other checkpoint quantizations are refused (ValueError, one
    line)."""
    is_gguf = find_gguf_file(model) is not None
    if is_gguf:
        if quantization not in (None, "gguf"):
            raise ValueError(
                f"--quantization {quantization} does not apply to the GGUF file {model} "
                "(its quantization is gguf; leave the flag out or pass gguf)"
            )
        return
    method = checkpoint_quant_method(model)
    if method is None and group_quant_config(model) is not None:
        method = GPTQ  # an AutoGPTQ checkpoint's quantize_config.json
    served = f"gguf files, {QUANT_METHOD}, GPTQ, AWQ, FP8 and MXFP4 (gpt-oss) checkpoints"
    if method is None:
        if (
            quantization == FP8_METHOD
        ):  # online FP8: the weights are rounded at load (models/fp8.py)
            return
        if quantization is not None:
            raise ValueError(
                f"--quantization {quantization} does not apply to {model}: it is not quantized "
                f"(nanoserve serves {served}, each implied by the model; --quantization fp8 "
                "rounds an unquantized one to FP8 at load)"
            )
        return
    if method not in (QUANT_METHOD, FP8_METHOD, MXFP4_METHOD, *GROUP_METHODS):
        raise ValueError(
            f"{model}: quantization_config.quant_method {method!r} is not supported; nanoserve "
            f"serves {served}"
        )
    accepted = FLAG_ALIASES.get(method, (method,))
    if quantization not in (None, *accepted):
        raise ValueError(
            f"--quantization {quantization} does not apply to {model} (its quantization is "
            f"{method}; leave the flag out or pass {' or '.join(accepted)})"
        )
    if method == QUANT_METHOD:
        compressed_tensors_config(model)
    elif method == FP8_METHOD:
        fp8_config(model)
    elif method != MXFP4_METHOD:  # MXFP4 has nothing to check before the tensors are read
        group_quant_config(model)
