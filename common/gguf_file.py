"""One parse of a GGUF file per process, by a reader of our own.

gguf's `GGUFReader` parses every metadata field eagerly through numpy, one memory-mapped array
per value (SmolLM2's 49k-token vocabulary and its merges field by field): ~4 s on this CPU, paid
by the gateway, the tokenizer and every worker of a mesh at start (each needs the context length,
a worker also the tokenizer and the weights), about 20 s of CPU per `pagemesh up` on 2 cores.
This reader walks the same layout with `struct` and decodes the string arrays in one loop: the
whole header in ~0.1 s. The tensors are memory-mapped as `GGUFReader` gives them (quantized
types as uint8 [..., bytes per row], the plain types in their numpy dtype), so gguf's
`dequantize` and our block conversions take them unchanged.

Layout (GGUF v2/v3; every integer in the file's byte order, little-endian unless the version
reads swapped):

    "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata: key (string) | value type u32 | value        string = length u64 | utf-8 bytes
                                                           array = item type u32 | count u64 | items
    tensor infos: name (string) | n_dims u32 | dims u64 x n_dims (innermost first) | type u32 | offset u64
    padding to general.alignment (default 32) | tensor data (each at its offset from here)
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUFValueType -> (struct code, numpy dtype) of the fixed-size scalars (gguf.constants numbers them)
_SCALARS = {
    0: ("B", np.uint8),
    1: ("b", np.int8),
    2: ("H", np.uint16),
    3: ("h", np.int16),
    4: ("I", np.uint32),
    5: ("i", np.int32),
    6: ("f", np.float32),
    7: ("?", np.bool_),
    10: ("Q", np.uint64),
    11: ("q", np.int64),
    12: ("d", np.float64),
}
_STRING, _ARRAY = 8, 9
# the tensor types stored as plain numbers (gguf.GGMLQuantizationType values); the rest are blocks
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass(frozen=True, kw_only=True)
class GGUFTensor:
    """One tensor of the file. `shape` is GGUF's (innermost dimension first); `data` is the
    read-only memory-mapped array `gguf.GGUFReader` would give (numpy order: `shape` reversed,
    and for a block-quantized type uint8 with the last dimension in bytes)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True, kw_only=True)
class GGUFFile:
    """The metadata (key -> value as Python values: str, int, float, bool or lists of them) and
    the tensors, in file order."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


def read_gguf(path: str | Path) -> GGUFFile:
    """The file's metadata and memory-mapped tensors (parsed once per process and path).
    ValueError for a file that is not GGUF or is cut short."""
    return _read(str(Path(path).resolve()))


_MAPPED: list[mmap.mmap] = []  # every file `_read` mapped, for drop_resident_pages


@functools.lru_cache(maxsize=4)
def _read(path: str) -> GGUFFile:
    with open(path, "rb") as f:
        raw = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        parsed = _parse(raw, path)
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"{Path(path).name}: not a readable GGUF file ({e})") from e
    _MAPPED.append(raw)
    return parsed


def drop_resident_pages() -> bool:
    """Take the pages of every GGUF file read so far out of this process's memory (madvise
    MADV_DONTNEED on the read-only mapping): they stay in the kernel's page cache, and a tensor
    read again faults its pages back in. A worker calls it once its model is loaded, when the
    weights live in its own tensors: loading touched the whole file (93 MB for the default model),
    and those pages would otherwise count in the worker's memory (PSS) for its life. False where
    the platform has no madvise."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return False
    for raw in _MAPPED:
        if not raw.closed:
            raw.madvise(mmap.MADV_DONTNEED)
    return True


def _parse(raw: mmap.mmap, path: str) -> GGUFFile:
    if raw[:4] != _MAGIC:
        raise ValueError(f"{Path(path).name}: not a GGUF file (no GGUF magic)")
    order = "<"
    (version,) = struct.unpack_from("<I", raw, 4)
    if version & 0xFFFF == 0:  # a big-endian file reads its small version number swapped
        order = ">"
        (version,) = struct.unpack_from(">I", raw, 4)
    if version not in (2, 3):
        raise ValueError(f"{Path(path).name}: GGUF version {version} is not supported (2 or 3)")
    reader = _Cursor(raw, order, 8)
    tensor_count, meta_count = reader.scalar(10), reader.scalar(10)
    metadata = {}
    for _ in range(meta_count):
        key = reader.string()
        metadata[key] = reader.value(reader.scalar(4))
    infos = []
    for _ in range(tensor_count):
        name = reader.string()
        dims = tuple(reader.scalar(10) for _ in range(reader.scalar(4)))
        infos.append((name, dims, reader.scalar(4), reader.scalar(10)))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{Path(path).name}: general.alignment {alignment} is not a power of two")
    start = -(-reader.offset // alignment) * alignment
    whole = np.frombuffer(raw, dtype=np.uint8)  # keeps the mapping alive as long as a tensor does
    return GGUFFile(metadata=metadata, tensors=[_tensor(whole, start, order, *info) for info in infos])


def _tensor(whole: np.ndarray, start: int, order: str, name: str, dims: tuple, type_id: int, offset: int) -> GGUFTensor:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    tensor_type = GGMLQuantizationType(type_id)
    n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
    numpy_shape = tuple(reversed(dims))
    if type_id in _PLAIN:
        dtype = np.dtype(_PLAIN[type_id]).newbyteorder(order)
        n_bytes = n_elements * dtype.itemsize
    else:
        dtype = np.dtype(np.uint8)
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        if numpy_shape[-1] % block_size:
            raise ValueError(f"GGUF tensor {name}: row of {numpy_shape[-1]} is not whole {tensor_type.name} blocks")
        n_bytes = n_elements * type_size // block_size
        numpy_shape = (*numpy_shape[:-1], numpy_shape[-1] // block_size * type_size)
    begin = start + offset
    if begin + n_bytes > whole.size:
        raise ValueError(f"GGUF tensor {name}: its data runs past the end of the file")
    data = whole[begin : begin + n_bytes].view(dtype).reshape(numpy_shape)
    return GGUFTensor(name=name, tensor_type=tensor_type, shape=dims, data=data)


class _Cursor:
    """Reads values from `raw` at `offset` onwards, in byte order `order` ('<' or '>')."""

    def __init__(self, raw: mmap.mmap, order: str, offset: int):
        self.raw, self.order, self.offset = raw, order, offset
        self._u64 = struct.Struct(order + "Q")

    def scalar(self, value_type: int) -> Any:
        code, dtype = _SCALARS[value_type]
        (value,) = struct.unpack_from(self.order + code, self.raw, self.offset)
        self.offset += np.dtype(dtype).itemsize
        return value

    def string(self) -> str:
        (length,) = self._u64.unpack_from(self.raw, self.offset)
        start = self.offset + 8
        self.offset = start + length
        if self.offset > len(self.raw):
            raise IndexError("a string runs past the end of the file")
        return self.raw[start : self.offset].decode("utf-8")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar(4), self.scalar(10)
            return self.array(item_type, count)
        if value_type not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {value_type}")
        return self.scalar(value_type)

    def array(self, item_type: int, count: int) -> list:
        if item_type in _SCALARS:  # numbers: one numpy view, converted to Python values at once
            dtype = np.dtype(_SCALARS[item_type][1]).newbyteorder(self.order)
            items = np.frombuffer(self.raw, dtype=dtype, count=count, offset=self.offset)
            self.offset += count * dtype.itemsize
            return items.tolist()
        if item_type == _STRING:  # the vocabulary and the merges: the loop that must be quick
            raw, u64, offset, out = self.raw, self._u64.unpack_from, self.offset, []
            for _ in range(count):
                (length,) = u64(raw, offset)
                offset += 8
                out.append(raw[offset : offset + length].decode("utf-8"))
                offset += length
            if offset > len(raw):
                raise IndexError("a string array runs past the end of the file")
            self.offset = offset
            return out
        return [self.value(item_type) for _ in range(count)]  # arrays of arrays
