"""One KV block as a file of a tier: what it holds, checked whole before it is served.

A file is named by its block hash (hex) and holds, in order: ``MAGIC``, a 4-byte little-endian
header length, the header (JSON: the layout key, the block's parent hash and tokens, the payload's
size and BLAKE2b checksum) and the payload (the block's KV pages in the engine's layout and
dtype). :func:`decode` refuses a file whose magic, header, layout, hash, parent, tokens, size or
checksum disagree with what the reader expects: a torn write, flipped bytes, or a block of another
model or layout is never served (the caller deletes it and computes the block). Files are written
whole under a temporary name and renamed into place (:func:`write_atomic`), so a reader sees a
complete file or none.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"PDKVBLK1"
CHECKSUM_BYTES = 16
_LENGTH = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 20  # a header names a block's tokens; far below this


class CorruptBlock(ValueError):
    """A tier file that does not hold the block asked for, whole."""


@dataclass(frozen=True)
class BlockRecord:
    """A block as a tier stores it."""

    block_hash: bytes
    parent: bytes
    tokens: tuple[int, ...]
    payload: bytes


def checksum(payload: bytes | memoryview) -> str:
    return hashlib.blake2b(payload, digest_size=CHECKSUM_BYTES).hexdigest()


def encode(record: BlockRecord, layout_key: str) -> bytes:
    header = json.dumps(
        {
            "layout": layout_key,
            "hash": record.block_hash.hex(),
            "parent": record.parent.hex(),
            "tokens": list(record.tokens),
            "size": len(record.payload),
            "checksum": checksum(record.payload),
        },
        separators=(",", ":"),
    ).encode()
    return MAGIC + _LENGTH.pack(len(header)) + header + record.payload


def decode(data: bytes, layout_key: str, block_hash: bytes) -> BlockRecord:
    """The block in ``data``, or :class:`CorruptBlock` saying what is wrong with it."""
    start = len(MAGIC) + _LENGTH.size
    if len(data) < start or not data.startswith(MAGIC):
        raise CorruptBlock("no block header")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    if length > MAX_HEADER_BYTES or start + length > len(data):
        raise CorruptBlock(f"header length {length} past the file's end")
    try:
        header = json.loads(data[start : start + length])
        parent, tokens = bytes.fromhex(header["parent"]), tuple(int(t) for t in header["tokens"])
        size, expected = int(header["size"]), str(header["checksum"])
        layout, named = str(header["layout"]), str(header["hash"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptBlock(f"unreadable header: {exc}") from exc
    if layout != layout_key:
        raise CorruptBlock(f"layout {layout!r}, not {layout_key!r}")
    if named != block_hash.hex():
        raise CorruptBlock(f"holds block {named}, not {block_hash.hex()}")
    payload = data[start + length :]
    if len(payload) != size:
        raise CorruptBlock(f"payload of {len(payload)} bytes, the header says {size}")
    if checksum(payload) != expected:
        raise CorruptBlock("payload checksum mismatch")
    return BlockRecord(block_hash, parent, tokens, payload)


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` as ``path``, whole or not at all (a temporary file renamed into place)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
