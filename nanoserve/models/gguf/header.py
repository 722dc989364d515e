"""A GGUF file's header read with every count and length checked against the bytes left before
anything is read or allocated: its metadata as plain values and its tensors' types, shapes and
places. The `gguf` package's reader trusts the file (an array count of 2^62 makes it loop while
memory grows until the process dies); anything that reads an untrusted file goes through here
first, and a malformed file is one GGUFImportError line naming the file, the byte and the part.

Little-endian GGUF versions 2 and 3, as llama.cpp writes them; the checks follow llama.cpp's own
loader (gguf.cpp): at most 4 dims, a known type, whole blocks a row, aligned offsets inside the
file, no duplicate keys or tensor names, strings in UTF-8."""

from __future__ import annotations

import mmap
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from nanoserve.models.gguf.reader import GGUFImportError

# The vocabulary's arrays: read by the tokenizer once, not cached (a 128k-token vocabulary and its
# merges are ~130 MiB as Python objects, held for the server's life otherwise); other reads skip them.
VOCABULARY_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
)
_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_MAX_DIMS = 4  # GGML_MAX_DIMS
_DEFAULT_ALIGNMENT = 32
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# GGUF value type → its little-endian struct format (standard sizes) and numpy dtype.
_SCALAR_FORMATS = {
    0: ("B", "<u1"),
    1: ("b", "<i1"),
    2: ("H", "<u2"),
    3: ("h", "<i2"),
    4: ("I", "<u4"),
    5: ("i", "<i4"),
    6: ("f", "<f4"),
    7: ("?", "?"),
    10: ("Q", "<u8"),
    11: ("q", "<i8"),
    12: ("d", "<f8"),
}
_SCALARS = {kind: dtype for kind, (_, dtype) in _SCALAR_FORMATS.items()}
_SCALAR_STRUCTS = {
    kind: struct.Struct("<" + layout) for kind, (layout, _) in _SCALAR_FORMATS.items()
}
_SCALAR_SIZES = {kind: layout.size for kind, layout in _SCALAR_STRUCTS.items()}
# The fewest bytes one item can take: a tensor's info (empty name, no dims, type, offset), a
# key/value pair (empty key, type, a one-byte value), an array's element.
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8
_MIN_KEY_VALUE = 8 + 4 + 1
_MIN_ELEMENT = {**_SCALAR_SIZES, _STRING: 8}


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """One tensor's entry: `shape` in GGUF's order (fastest dim first), `data_offset` from the
    start of the file, `n_bytes` inside it (checked)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data_offset: int


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """`metadata`: key → plain value (lists for arrays), less the keys a read skipped;
    `array_lengths`: every array's length, skipped or not."""

    metadata: dict
    tensors: list[GGUFTensorInfo]
    array_lengths: dict[str, int]


class _Cursor:
    """A position in the mapped file; every read checks the bytes left first."""

    def __init__(self, buffer, file_name: str):
        self.buffer, self.size, self.position, self.file_name = buffer, len(buffer), 0, file_name

    def fail(self, what: str) -> GGUFImportError:
        return GGUFImportError(
            f"cannot read {self.file_name} as GGUF: {what} (byte {self.position} of {self.size})"
        )

    def skip(self, size: int, what: str) -> int:
        """Where `size` bytes start; the cursor moves past them."""
        start = self.position
        if size > self.size - start:
            raise self.fail(f"{what} needs {size} bytes, the file has {self.size - start} left")
        self.position = start + size
        return start

    def unpack(self, layout: struct.Struct, what: str):
        return layout.unpack_from(self.buffer, self.skip(layout.size, what))[0]

    def count(self, smallest_item: int, what: str) -> int:
        """A uint64 count of items of at least `smallest_item` bytes each, all of which must fit in
        what is left of the file: checked before anything is allocated for them."""
        count = self.unpack(_U64, what)
        if count * smallest_item > self.size - self.position:
            raise self.fail(
                f"{what} {count} does not fit in the {self.size - self.position} bytes left"
            )
        return count

    def string(self, what: str) -> str:
        length = self.unpack(_U64, f"{what}'s length")
        start = self.skip(length, what)
        try:
            return self.buffer[start : start + length].decode("utf-8")
        except UnicodeDecodeError:
            self.position = start
            raise self.fail(f"{what} is not UTF-8") from None


def _value(cursor: _Cursor, kind: int, key: str, lengths: dict[str, int], keep: bool = True):
    """One metadata value of GGUF type `kind` (an array's length into `lengths`; `keep` False: the
    array checked and passed over, its value None)."""
    if kind in _SCALAR_STRUCTS:
        return cursor.unpack(_SCALAR_STRUCTS[kind], f"{key}'s value")
    if kind == _STRING:
        return cursor.string(f"{key}'s value")
    if kind != _ARRAY:
        raise cursor.fail(f"{key} has unknown value type {kind}")
    item_kind = cursor.unpack(_U32, f"{key}'s element type")
    if item_kind not in _MIN_ELEMENT:
        raise cursor.fail(f"{key} is an array of unsupported type {item_kind}")
    count = lengths[key] = cursor.count(_MIN_ELEMENT[item_kind], f"{key}'s element count")
    if item_kind == _STRING:
        return _strings(cursor, count, key, keep)
    start = cursor.skip(count * _SCALAR_SIZES[item_kind], f"{key}'s elements")
    if not keep:
        return None
    return np.frombuffer(
        cursor.buffer, dtype=_SCALARS[item_kind], count=count, offset=start
    ).tolist()


def _strings(cursor: _Cursor, count: int, key: str, keep: bool) -> list[str] | None:
    """An array of `count` strings: _Cursor.string's checks, in one loop (a vocabulary has 10^5);
    `keep` False: their lengths checked, nothing decoded."""
    buffer, size, position, values = cursor.buffer, cursor.size, cursor.position, []
    unpack = _U64.unpack_from
    for index in range(count):
        end = position + 8
        if end <= size:
            end += unpack(buffer, position)[0]
        if end > size:
            cursor.position = position
            raise cursor.fail(f"{key}[{index}] runs past the end of the file")
        try:
            if keep:
                values.append(buffer[position + 8 : end].decode("utf-8"))
        except UnicodeDecodeError:
            cursor.position = position
            raise cursor.fail(f"{key}[{index}] is not UTF-8") from None
        position = end
    cursor.position = position
    return values if keep else None


def _metadata(cursor: _Cursor, count: int, skip: Collection[str], lengths: dict[str, int]) -> dict:
    metadata = {}
    for _ in range(count):
        key = cursor.string("a metadata key")
        if key in metadata:
            raise cursor.fail(f"metadata key {key!r} appears twice")
        kind = cursor.unpack(_U32, f"{key}'s type")
        if key == "general.alignment" and kind != _UINT32:
            raise cursor.fail(f"general.alignment has type {kind}, not uint32")
        value = _value(cursor, kind, key, lengths, key not in skip)
        if key not in skip:
            metadata[key] = value
    return metadata


def _tensor_entry(
    cursor: _Cursor, names: set[str]
) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    """(name, shape, type, offset in the data section) of the next tensor info."""
    name = cursor.string("a tensor name")
    if name in names:
        raise cursor.fail(f"tensor {name!r} appears twice")
    names.add(name)
    n_dims = cursor.unpack(_U32, f"{name}'s number of dims")
    if not 1 <= n_dims <= _MAX_DIMS:
        raise cursor.fail(f"{name} has {n_dims} dims (1 to {_MAX_DIMS} allowed)")
    shape = struct.unpack_from(
        f"<{n_dims}Q", cursor.buffer, cursor.skip(8 * n_dims, f"{name}'s dims")
    )
    if 0 in shape:
        raise cursor.fail(f"{name} has an empty dim {list(shape)}")
    raw_type = cursor.unpack(_U32, f"{name}'s type")
    try:
        tensor_type = GGMLQuantizationType(raw_type)
        GGML_QUANT_SIZES[tensor_type]
    except (ValueError, KeyError):
        raise cursor.fail(f"{name} has unknown tensor type {raw_type}") from None
    offset = cursor.unpack(_U64, f"{name}'s offset")
    return name, shape, tensor_type, offset


def _tensor_info(entry, data_start: int, alignment: int, file_size: int, fail) -> GGUFTensorInfo:
    name, shape, tensor_type, offset = entry
    block, block_bytes = GGML_QUANT_SIZES[tensor_type]
    if shape[0] % block:
        raise fail(
            f"{name}: {shape[0]} values a row are not whole {tensor_type.name} blocks of {block}"
        )
    if offset % alignment:
        raise fail(f"{name}'s offset {offset} is not a multiple of the alignment {alignment}")
    n_bytes = int(np.prod(shape, dtype=object)) // block * block_bytes
    if data_start + offset + n_bytes > file_size:
        raise fail(
            f"{name}'s {n_bytes} bytes at {data_start + offset} run past the end of the file"
        )
    return GGUFTensorInfo(name, tensor_type, tuple(shape), n_bytes, data_start + offset)


def parse_gguf_header(buffer, file_name: str, skip: Collection[str] = ()) -> GGUFHeader:
    """The header of a GGUF file held in `buffer` (bytes or a mapping of the whole file); the
    keys in `skip` are checked but not kept (a vocabulary's arrays where only their length counts)."""
    cursor = _Cursor(buffer, file_name)
    if bytes(buffer[:4]) != _MAGIC:
        raise cursor.fail("no GGUF magic")
    cursor.skip(4, "magic")
    version = cursor.unpack(_U32, "the version")
    if version & 0xFFFF == 0 and version:
        raise cursor.fail("a big-endian GGUF file is not supported")
    if version not in _VERSIONS:
        raise cursor.fail(f"GGUF version {version} is not supported (2 or 3)")
    tensor_count = cursor.count(0, "tensor count")  # checked against the bytes once kv are read
    kv_count = cursor.count(_MIN_KEY_VALUE, "key/value count")
    lengths: dict[str, int] = {}
    metadata = _metadata(cursor, kv_count, skip, lengths)
    if tensor_count * _MIN_TENSOR_INFO > cursor.size - cursor.position:
        raise cursor.fail(
            f"tensor count {tensor_count} does not fit in the {cursor.size - cursor.position} "
            "bytes left"
        )
    names: set[str] = set()
    entries = [_tensor_entry(cursor, names) for _ in range(tensor_count)]
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if alignment <= 0 or alignment & (alignment - 1):
        raise cursor.fail(f"general.alignment {alignment} is not a power of two")
    data_start = -(-cursor.position // alignment) * alignment
    tensors = [
        _tensor_info(entry, data_start, alignment, cursor.size, cursor.fail) for entry in entries
    ]
    return GGUFHeader(metadata, tensors, lengths)


def read_gguf_header(path: Path | str, skip: Collection[str] = ()) -> GGUFHeader:
    """The file's header, checked (GGUFImportError, one line, for a malformed or unreadable file).
    The file is mapped, not read: only the header's pages are touched."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            size = path.stat().st_size
            if size < 4 + 4 + 8 + 8:
                raise GGUFImportError(
                    f"cannot read {path} as GGUF: only {size} bytes, too short for a header"
                )
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except GGUFImportError:
        raise
    except (OSError, ValueError) as error:  # (mmap: ValueError for a file emptied meanwhile)
        raise GGUFImportError(f"cannot read {path} as GGUF: {error}") from error
    with mapped:
        return parse_gguf_header(mapped, str(path), skip)
