"""The GGUF container: header (metadata + tensor table) and each tensor's raw bytes.

The gguf package's GGUFReader builds a numpy view for every metadata string, which takes seconds
on a 49k-entry vocabulary; walking the header with `struct` takes a few tens of milliseconds.
Type ids and block sizes still come from the gguf package. Every malformed or truncated file
raises ModelFileError naming the file.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from io import BufferedReader
from math import prod
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from minimill.models.types import ModelFileError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# (struct format, width) of the fixed-size metadata value types.
_SCALARS: dict[int, tuple[str, int]] = {
    GGUFValueType.UINT8: ("B", 1), GGUFValueType.INT8: ("b", 1), GGUFValueType.BOOL: ("?", 1),
    GGUFValueType.UINT16: ("H", 2), GGUFValueType.INT16: ("h", 2),
    GGUFValueType.UINT32: ("I", 4), GGUFValueType.INT32: ("i", 4),
    GGUFValueType.FLOAT32: ("f", 4), GGUFValueType.UINT64: ("Q", 8),
    GGUFValueType.INT64: ("q", 8), GGUFValueType.FLOAT64: ("d", 8),
}


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file and how it is stored."""

    name: str
    shape: tuple[int, ...]  # torch order: ggml's `ne` reversed
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """Everything in a GGUF file except the tensor data."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]  # in file order
    data_offset: int


class _Cursor:
    """Bounds-checked little-endian reads over the mapped header."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def fail(self, why: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: not a valid GGUF file ({why} at byte {self.pos})")

    def take(self, fmt: str, width: int) -> tuple[Any, ...]:
        if self.pos + width > self.size:
            raise self.fail("file ends inside the header")
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += width
        return values

    def string(self) -> str:
        (length,) = self.take("Q", 8)
        if self.pos + length > self.size:
            raise self.fail(f"string of {length} bytes runs past the end of the file")
        raw = self.buf[self.pos:self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail("string is not UTF-8") from exc

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self.take(*_SCALARS[value_type])[0]
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type == GGUFValueType.ARRAY:
            item_type, count = self.take("IQ", 12)
            if item_type in _SCALARS:
                fmt, width = _SCALARS[item_type]
                return list(self.take(f"{count}{fmt}", count * width))
            if item_type == GGUFValueType.STRING:
                # Each string needs at least its 8-byte length: reject absurd counts early.
                if self.pos + 8 * count > self.size:
                    raise self.fail(f"array of {count} strings runs past the end of the file")
                return [self.string() for _ in range(count)]
            raise self.fail(f"unsupported array item type {item_type}")
        raise self.fail(f"unknown metadata value type {value_type}")


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse metadata and the tensor table; checks that every tensor lies inside the file."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            file_size = path.stat().st_size
            if file_size < 24:
                raise ModelFileError(f"{path}: not a valid GGUF file (only {file_size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(_Cursor(buf, path), file_size)
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read model file ({exc.strerror or exc})") from exc


def _parse(cur: _Cursor, file_size: int) -> GGUFHeader:
    if cur.buf[:4] != _MAGIC:
        raise ModelFileError(f"{cur.path}: not a GGUF file (no GGUF magic bytes)")
    cur.pos = 4
    version, tensor_count, kv_count = cur.take("IQQ", 20)
    if version not in _VERSIONS:
        raise cur.fail(f"unsupported GGUF version {version}")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        (value_type,) = cur.take("I", 4)
        metadata[key] = cur.value(value_type)
    entries = []
    for _ in range(tensor_count):
        name = cur.string()
        (num_dims,) = cur.take("I", 4)
        if num_dims > 8:
            raise cur.fail(f"tensor {name!r} has {num_dims} dimensions")
        ne = cur.take(f"{num_dims}Q", 8 * num_dims)
        raw_type, rel_offset = cur.take("IQ", 12)
        entries.append((name, tuple(reversed(ne)), raw_type, rel_offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"alignment {alignment} is not a power of two")
    data_offset = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, raw_type, rel_offset in entries:
        info = _tensor_info(cur.path, name, shape, raw_type, data_offset + rel_offset)
        if info.offset + info.nbytes > file_size:
            raise ModelFileError(
                f"{cur.path}: truncated model file: tensor {name!r} ends at byte "
                f"{info.offset + info.nbytes} but the file has {file_size} bytes")
        tensors[name] = info
    return GGUFHeader(cur.path, version, metadata, tensors, data_offset)


def _tensor_info(path: Path, name: str, shape: tuple[int, ...], raw_type: int,
                 offset: int) -> GGUFTensorInfo:
    try:
        ggml_type = GGMLQuantizationType(raw_type)
    except ValueError as exc:
        raise ModelFileError(f"{path}: tensor {name!r} has unknown ggml type {raw_type}") from exc
    block_elements, block_bytes = GGML_QUANT_SIZES[ggml_type]
    count = prod(shape)
    if count % block_elements:
        raise ModelFileError(f"{path}: tensor {name!r} of {count} elements is not a whole "
                             f"number of {ggml_type.name} blocks")
    return GGUFTensorInfo(name, shape, ggml_type, offset, count // block_elements * block_bytes)


def read_tensor_bytes(f: BufferedReader, info: GGUFTensorInfo, path: Path) -> bytearray:
    """One tensor's raw bytes, in a fresh writable buffer (torch.frombuffer wants one)."""
    buf = bytearray(info.nbytes)
    f.seek(info.offset)
    got = f.readinto(buf)
    if got != info.nbytes:
        raise ModelFileError(f"{path}: truncated model file: tensor {info.name!r} has "
                             f"{got} of {info.nbytes} bytes")
    return buf
