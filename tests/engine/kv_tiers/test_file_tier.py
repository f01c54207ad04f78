"""A folder of block files as a tier: capped and least recently used out, shared with other
workers, rebuilt after a restart, and never serving a file that fails its checks."""

from __future__ import annotations

import os

import pytest

from engine.errors import ConfigError
from engine.kv_tiers.block_file import BlockRecord
from engine.kv_tiers.file_tier import FileTier

LAYOUT = "fp|layout|float32|4|2|2|8"
PAYLOAD = bytes(1000)


def record(n: int) -> BlockRecord:
    return BlockRecord(bytes([n]) * 16, bytes([n + 100]) * 16, (n, n + 1), PAYLOAD)


def load(tier: FileTier, n: int) -> BlockRecord | None:
    r = record(n)
    return tier.load(r.block_hash, r.parent, r.tokens)


def test_what_is_stored_loads_back_and_counts(tmp_path):
    tier = FileTier("host", tmp_path, 1 << 20, LAYOUT)
    assert tier.store(record(1))
    assert load(tier, 1) == record(1) and load(tier, 2) is None
    assert (tier.stats.blocks, tier.stats.stored, tier.stats.hits) == (1, 1, 1)
    assert tier.stats.bytes == tier.path_of(record(1).block_hash).stat().st_size


def test_past_its_cap_the_least_recently_used_go(tmp_path):
    tier = FileTier("host", tmp_path, 4000, LAYOUT)  # three files of ~1.2 kB
    for n in (1, 2, 3):
        tier.store(record(n))
    assert load(tier, 1) is not None  # 2 is now the oldest
    tier.store(record(4))
    assert record(2).block_hash not in tier and load(tier, 2) is None
    assert all(record(n).block_hash in tier for n in (1, 3, 4))
    assert tier.stats.evicted == 1 and tier.stats.bytes <= 4000


def test_another_worker_and_a_restarted_one_find_the_files(tmp_path):
    writer = FileTier("host", tmp_path, 1 << 20, LAYOUT)
    reader = FileTier("host", tmp_path, 1 << 20, LAYOUT)
    writer.store(record(1))
    assert load(reader, 1) == record(1)  # written after the reader started
    restarted = FileTier("disk", tmp_path, 1 << 20, LAYOUT)
    assert restarted.stats.blocks == 1 and load(restarted, 1) == record(1)
    other_layout = FileTier("disk", tmp_path, 1 << 20, LAYOUT.replace("float32", "float16"))
    assert other_layout.stats.blocks == 0 and load(other_layout, 1) is None


def test_a_damaged_file_is_deleted_and_counted_never_served(tmp_path):
    tier = FileTier("disk", tmp_path, 1 << 20, LAYOUT)
    tier.store(record(1))
    path = tier.path_of(record(1).block_hash)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert load(tier, 1) is None and not path.exists()
    assert (tier.stats.corrupt, tier.stats.blocks, tier.stats.hits) == (1, 0, 0)


def test_a_block_of_another_prefix_under_the_hash_is_a_miss_not_damage(tmp_path):
    tier = FileTier("disk", tmp_path, 1 << 20, LAYOUT)
    tier.store(record(1))
    r = record(1)
    assert tier.load(r.block_hash, r.parent, (9, 9)) is None
    assert tier.load(r.block_hash, b"\x00" * 16, r.tokens) is None
    assert tier.stats.corrupt == 0 and r.block_hash in tier


def test_a_failed_write_is_counted_and_skipped(tmp_path):
    tier = FileTier("disk", tmp_path, 1 << 20, LAYOUT)
    for path in tier.directory.iterdir():
        path.unlink()
    tier.directory.rmdir()  # as a disk that fails under it
    assert not tier.store(record(1))
    assert tier.stats.failed_writes == 1 and tier.stats.blocks == 0


def test_a_folder_other_users_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match="writable by other users"):
        FileTier("host", shared, 1 << 20, LAYOUT)
    made = tmp_path / "new" / "tier"
    FileTier("host", made, 1 << 20, LAYOUT)
    assert made.stat().st_mode & 0o777 == 0o700
