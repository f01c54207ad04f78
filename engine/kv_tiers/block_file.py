"""One KV block as a file of a tier: what it holds, checked whole before it is served.

A file is named by its block hash (hex) and holds, in order: ``MAGIC``, a 4-byte little-endian
header length, the header (JSON: the layout key, the block's parent hash and tokens, the payload's
size and CRC-32) and the payload (the block's KV pages in the engine's layout and dtype).
:func:`read_block` refuses a file whose magic, header, layout, hash, size or checksum disagree
with what the reader expects: a torn write, flipped bytes, or a block of another model or layout
is never served (the caller deletes it and computes the block; it checks the parent and tokens).
The checksum guards against damage, not forgery: the folders are the worker user's alone
(``file_tier.private_root``). CRC-32 finds every burst of up to 32 flipped bits and all but 2^-32
of other damage, at 2.5-5 GB/s on one core (BLAKE2b, before it: under 1 GB/s, half of a block's
load time). The payload is read straight into the caller's buffer (:func:`read_block`'s
``buffer_for``): the engine reads a prompt's blocks into one tensor it then copies into its cache.
Files are written whole under a temporary name and renamed into place (:func:`write_atomic`), so
a reader sees a complete file or none.
"""

from __future__ import annotations

import io
import json
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

MAGIC = b"PDKVBLK2"  # 1: BLAKE2b checksums (such files are refused, then computed and rewritten)
_LENGTH = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 20  # a header names a block's tokens; far below this
MAX_PAYLOAD_BYTES = 1 << 31  # one block's pages; far below this


class Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...

    def readinto(self, buffer: memoryview, /) -> int | None: ...


class CorruptBlock(ValueError):
    """A tier file that does not hold the block asked for, whole."""


@dataclass(frozen=True)
class BlockRecord:
    """A block as a tier stores it."""

    block_hash: bytes
    parent: bytes
    tokens: tuple[int, ...]
    payload: bytes | memoryview


def checksum(payload: bytes | memoryview) -> int:
    return zlib.crc32(payload)


def header_of(record: BlockRecord, layout_key: str) -> bytes:
    """What a block's file holds before its payload."""
    header = json.dumps(
        {
            "layout": layout_key,
            "hash": record.block_hash.hex(),
            "parent": record.parent.hex(),
            "tokens": list(record.tokens),
            "size": len(record.payload),
            "crc32": checksum(record.payload),
        },
        separators=(",", ":"),
    ).encode()
    return MAGIC + _LENGTH.pack(len(header)) + header


def encode(record: BlockRecord, layout_key: str) -> bytes:
    return header_of(record, layout_key) + bytes(record.payload)


def read_block(
    file: Readable,
    layout_key: str,
    block_hash: bytes,
    buffer_for: Callable[[int], memoryview],
) -> tuple[bytes, tuple[int, ...], memoryview]:
    """The block in ``file``: its parent hash, tokens and payload, read into
    ``buffer_for(size)``; :class:`CorruptBlock` saying what is wrong with it."""
    start = file.read(len(MAGIC) + _LENGTH.size)
    if len(start) < len(MAGIC) + _LENGTH.size or not start.startswith(MAGIC):
        raise CorruptBlock("no block header")
    (length,) = _LENGTH.unpack_from(start, len(MAGIC))
    raw = file.read(length) if length <= MAX_HEADER_BYTES else b""
    if len(raw) != length:
        raise CorruptBlock(f"header length {length} past the file's end")
    try:
        header = json.loads(raw)
        parent, tokens = bytes.fromhex(header["parent"]), tuple(int(t) for t in header["tokens"])
        size, expected = int(header["size"]), int(header["crc32"])
        layout, named = str(header["layout"]), str(header["hash"])
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
        raise CorruptBlock(f"unreadable header: {exc}") from exc
    if layout != layout_key:
        raise CorruptBlock(f"layout {layout!r}, not {layout_key!r}")
    if named != block_hash.hex():
        raise CorruptBlock(f"holds block {named}, not {block_hash.hex()}")
    if not 0 <= size <= MAX_PAYLOAD_BYTES:
        raise CorruptBlock(f"payload size {size} out of range")
    payload = buffer_for(size)
    received = file.readinto(payload)
    if received != size or file.read(1):
        raise CorruptBlock(f"payload of {received if received != size else 'more'} bytes, "
                           f"the header says {size}")  # fmt: skip
    if checksum(payload) != expected:
        raise CorruptBlock("payload checksum mismatch")
    return parent, tokens, payload


def decode(data: bytes, layout_key: str, block_hash: bytes) -> BlockRecord:
    """The block in ``data`` (a whole file), or :class:`CorruptBlock`."""
    parent, tokens, payload = read_block(
        io.BytesIO(data), layout_key, block_hash, lambda size: memoryview(bytearray(size))
    )
    return BlockRecord(block_hash, parent, tokens, bytes(payload))


def write_atomic(path: Path, *parts: bytes | memoryview) -> None:
    """``parts`` as ``path``, whole or not at all (a temporary file renamed into place)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            for part in parts:
                file.write(part)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
