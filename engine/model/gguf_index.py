"""A GGUF file's tensors, read from its header alone: each tensor's name, type, shape and its
bytes as a view of the memory-mapped file, and the string metadata asked for.

``gguf.GGUFReader`` decodes every metadata value into numpy objects, the tokenizer's ~49k-entry
arrays included: ~12 s for SmolLM2-135M on a small CPU, at every engine start. Here the metadata
is skipped over (a string array by its lengths alone) and only the header's tensor table is
decoded, in milliseconds. The format (little-endian, versions 2 and 3): ``GGUF``, the version,
the tensor and metadata counts, the metadata (key, type, value), the tensor table (name, dims
innermost first, type, offset), then the data, aligned to ``general.alignment`` (default 32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

ALIGNMENT = 32  # gguf's default, where general.alignment is not set
STRING, ARRAY, UINT32 = 8, 9, 4
# the fixed sizes of the scalar value types (uint8 ... float64; 8: string, 9: array)
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class GGUFFormatError(ValueError):
    """A file this reader does not take (not GGUF, big-endian, version 1, truncated)."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` as GGUF lists it (the row length first); ``data`` its bytes, uint8
    ``[rows, bytes a row]`` (rows: the product of the outer dimensions)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFIndex:
    tensors: list[GGUFTensor]
    strings: dict[str, str]  # the string metadata asked for that the file has


class _Cursor:
    def __init__(self, buffer: memoryview) -> None:
        self.buffer, self.at = buffer, 0

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.take("<Q")
        text = bytes(self.buffer[self.at : self.at + size]).decode("utf-8", "replace")
        self.at += size
        return text

    def skip_value(self, value_type: int) -> None:
        if value_type in SCALAR_BYTES:
            self.at += SCALAR_BYTES[value_type]
        elif value_type == STRING:
            size = self.take("<Q")  # read before ``at`` moves past it
            self.at += size
        elif value_type == ARRAY:
            item_type, count = self.take("<I"), self.take("<Q")
            if item_type in SCALAR_BYTES:
                self.at += SCALAR_BYTES[item_type] * count
            else:
                for _ in range(count):
                    self.skip_value(item_type)
        else:
            raise GGUFFormatError(f"unknown metadata value type {value_type}")


def read_index(path: Path, strings: tuple[str, ...] = ()) -> GGUFIndex:
    """The tensors of the GGUF file at ``path`` and its string metadata named in ``strings``;
    :class:`GGUFFormatError` for a file this reader does not take."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(mapped.data)
    try:
        return _read(mapped, cursor, strings)
    except (struct.error, IndexError, UnicodeDecodeError) as exc:
        raise GGUFFormatError(f"{path}: truncated or malformed header ({exc})") from exc


def _read(mapped: np.ndarray, cursor: _Cursor, wanted: tuple[str, ...]) -> GGUFIndex:
    if bytes(cursor.buffer[:4]) != b"GGUF":
        raise GGUFFormatError("not a GGUF file")
    cursor.at = 4
    version = cursor.take("<I")
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} (a big-endian file, or version 1)")
    num_tensors, num_fields = cursor.take("<Q"), cursor.take("<Q")
    alignment, strings = ALIGNMENT, {}
    for _ in range(num_fields):
        key, value_type = cursor.string(), cursor.take("<I")
        if key == "general.alignment" and value_type == UINT32:
            alignment = cursor.take("<I")
        elif key in wanted and value_type == STRING:
            strings[key] = cursor.string()
        else:
            cursor.skip_value(value_type)
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment {alignment} is not a power of two")
    table = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = tuple(cursor.take("<Q") for _ in range(cursor.take("<I")))
        table.append((name, GGMLQuantizationType(cursor.take("<I")), dims, cursor.take("<Q")))
    start = -(-cursor.at // alignment) * alignment
    tensors = []
    for name, tensor_type, dims, offset in table:
        block, block_bytes = GGML_QUANT_SIZES[tensor_type]
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        row_bytes = dims[0] // block * block_bytes if dims else block_bytes
        begin = start + offset
        if begin + rows * row_bytes > len(mapped):
            raise GGUFFormatError(f"tensor {name} runs past the end of the file")
        data = mapped[begin : begin + rows * row_bytes].reshape(rows, row_bytes)
        tensors.append(GGUFTensor(name, tensor_type, dims, data))
    return GGUFIndex(tensors, strings)
