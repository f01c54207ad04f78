"""A tier's block file: what is written reads back whole, and anything else is refused."""

from __future__ import annotations

import pytest

from engine.kv_tiers.block_file import BlockRecord, CorruptBlock, decode, encode, write_atomic

LAYOUT = "fp|layout|float32|4|2|2|8"
RECORD = BlockRecord(b"\x01" * 16, b"\x02" * 16, (5, 6, 7, 8), bytes(range(256)) * 4)


def test_a_block_reads_back_as_written():
    assert decode(encode(RECORD, LAYOUT), LAYOUT, RECORD.block_hash) == RECORD


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: d[: len(d) - 1], "payload of"),  # torn write
        (lambda d: d[:-10] + bytes([d[-10] ^ 0x40]) + d[-9:], "checksum"),  # a flipped bit
        (lambda d: d[:6], "no block header"),
        (lambda d: b"X" + d[1:], "no block header"),
        (lambda d: d[:12] + b"#" + d[13:], "unreadable header"),
        (lambda d: d[:8] + b"\xff\xff\xff\x00" + d[12:], "past the file's end"),
        (lambda d: d.replace(b'"size":1024', b'"size":1e999'), "unreadable header"),
    ],
    ids=["truncated", "flipped", "short", "magic", "header", "length", "overflow"],
)
def test_damage_anywhere_is_refused(damage, message):
    with pytest.raises(CorruptBlock, match=message):
        decode(damage(encode(RECORD, LAYOUT)), LAYOUT, RECORD.block_hash)


def test_a_block_of_another_layout_or_hash_is_refused():
    data = encode(RECORD, LAYOUT)
    with pytest.raises(CorruptBlock, match="layout"):
        decode(data, LAYOUT.replace("float32", "bfloat16"), RECORD.block_hash)
    with pytest.raises(CorruptBlock, match="holds block"):
        decode(data, LAYOUT, b"\x03" * 16)


def test_a_write_is_whole_or_absent(tmp_path):
    path = tmp_path / "block"
    write_atomic(path, b"abc")
    assert path.read_bytes() == b"abc" and [p.name for p in tmp_path.iterdir()] == ["block"]
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "missing" / "block", b"abc")
    assert [p.name for p in tmp_path.iterdir()] == ["block"]
