"""KV tiers under a real (tiny) engine: a prefix its cache evicted comes back from the
node-shared tier or from disk (after a restart too) as cached tokens, with the very tokens of a
computed one; damaged files, another layout and another tenant are computed, never served."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.support.block_checks import check_consistent

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=6, do_sample=True, temperature=1.2, seed=3, ignore_eos=True)
PROMPT = list(range(20, 61))  # 41 tokens: ten full blocks of 4, the last token computed
OTHERS = [list(range(100 + 50 * i, 141 + 50 * i)) for i in range(3)]  # what evicts PROMPT


def _engine(loaded, tmp_path: Path, kv_cache_dtype: str = "auto", **tiers) -> LLMEngine:
    cache = CacheConfig(block_size=4, num_blocks=24, **tiers)
    config = EngineConfig(
        model_path=str(loaded.path), device="cpu", cache=cache, kv_cache_dtype=kv_cache_dtype
    )
    return LLMEngine(config, loaded)


def _evict_prompt(engine: LLMEngine) -> None:
    """PROMPT's blocks out of the device cache (into the tiers), written."""
    engine.generate(OTHERS, GREEDY)
    assert engine.blocks.lookup([], PROMPT) == []
    assert engine.tiers is not None
    engine.tiers.flush()


def _run(engine: LLMEngine, prompt: list[int], params=GREEDY, tenant: str = "") -> tuple:
    engine.add_request(engine.request("r", prompt, params, tenant=tenant))
    events = []
    while engine.has_work():
        events += engine.step()
    check_consistent(engine.blocks)
    tokens = [e.token_id for e in events if e.token_id is not None]
    return tokens, events[-1].num_cached_tokens


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_an_evicted_prefix_comes_back_from_the_shared_tier(tiny_loaded, tmp_path, params):
    engine = _engine(tiny_loaded, tmp_path, host_tier_mb=4, host_tier_path=str(tmp_path / "shm"))
    computed, cached = _run(engine, PROMPT, params)
    assert cached == 0
    _evict_prompt(engine)
    again, cached = _run(engine, PROMPT, params)
    assert again == computed and cached == 40  # ten blocks served, the last token computed
    assert engine.blocks.num_promoted_blocks == 10
    (host,) = engine.tiers.stats()
    assert host.hits == 10 and host.corrupt == 0
    plain = _engine(tiny_loaded, tmp_path)
    assert _run(plain, PROMPT, params)[0] == computed


def test_a_worker_beside_it_reads_what_it_demoted(tiny_loaded, tmp_path):
    shared = {"host_tier_mb": 4, "host_tier_path": str(tmp_path / "shm")}
    first, second = (
        _engine(tiny_loaded, tmp_path, **shared),
        _engine(tiny_loaded, tmp_path, **shared),
    )
    computed, _ = _run(first, PROMPT)
    _evict_prompt(first)
    assert _run(second, PROMPT) == (computed, 40)


def _disk(tmp_path: Path) -> dict:
    return {"disk_tier_mb": 4, "disk_tier_path": str(tmp_path / "disk"), "disk_admit_after": 1}


def test_the_disk_tier_survives_a_restart(tiny_loaded, tmp_path):
    engine = _engine(tiny_loaded, tmp_path, **_disk(tmp_path))
    computed, _ = _run(engine, PROMPT)
    _evict_prompt(engine)
    engine.tiers.close()
    restarted = _engine(tiny_loaded, tmp_path, **_disk(tmp_path))
    assert restarted.tiers.stats()[0].blocks >= 10  # the index rebuilt from the files
    assert _run(restarted, PROMPT) == (computed, 40)


def test_disk_admits_a_block_only_on_its_second_demotion_or_after_a_hit(tiny_loaded, tmp_path):
    disk = {**_disk(tmp_path), "disk_admit_after": 2}
    engine = _engine(tiny_loaded, tmp_path, **disk)
    _run(engine, PROMPT)
    _evict_prompt(engine)
    assert engine.tiers.stats()[0].stored == 0  # demoted once: not worth a disk write
    _run(engine, PROMPT)  # computed again: its blocks cached again
    _evict_prompt(engine)
    assert engine.tiers.stats()[0].stored >= 10


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_files_are_computed_never_served(tiny_loaded, tmp_path, damage):
    engine = _engine(tiny_loaded, tmp_path, **_disk(tmp_path))
    computed, _ = _run(engine, PROMPT)
    _evict_prompt(engine)
    engine.tiers.close()
    for path in (tmp_path / "disk").rglob("*.kvb"):
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data if damage == "flip" else data[: len(data) - 3]))
    restarted = _engine(tiny_loaded, tmp_path, **_disk(tmp_path))
    assert _run(restarted, PROMPT) == (computed, 0)
    assert restarted.tiers.stats()[0].corrupt == 1  # the first block: nothing after it is read
    assert restarted.blocks.num_promoted_blocks == 0


def test_another_layout_or_tenant_never_matches(tiny_loaded, tmp_path):
    engine = _engine(tiny_loaded, tmp_path, **_disk(tmp_path))
    _run(engine, PROMPT)
    _evict_prompt(engine)
    assert _run(engine, PROMPT, tenant="other")[1] == 0  # another tenant's chain of hashes
    halved = _engine(tiny_loaded, tmp_path, kv_cache_dtype="float16", **_disk(tmp_path))
    assert _run(halved, PROMPT)[1] == 0 and halved.blocks.num_promoted_blocks == 0


def test_an_idle_worker_writes_its_reused_blocks_so_a_crash_loses_none(tiny_loaded, tmp_path):
    disk = {**_disk(tmp_path), "disk_admit_after": 2}
    engine = _engine(tiny_loaded, tmp_path, **disk)
    computed, _ = _run(engine, PROMPT)
    assert engine.checkpoint_tiers() == 0  # computed once: nothing reused yet
    assert _run(engine, PROMPT) == (computed, 40)  # the second turn hits the device cache
    assert engine.checkpoint_tiers() == 10 and engine.checkpoint_tiers() == 0
    engine.tiers.flush()  # then the worker dies: nothing was evicted, nothing closed
    restarted = _engine(tiny_loaded, tmp_path, **disk)
    assert _run(restarted, PROMPT) == (computed, 40)


def test_a_demotion_is_an_event_of_its_tier_and_the_snapshot_names_the_tiers_blocks(
    tiny_loaded, tmp_path
):
    engine = _engine(tiny_loaded, tmp_path, host_tier_mb=4, host_tier_path=str(tmp_path / "shm"))
    _run(engine, PROMPT)
    hashes = engine.blocks.extend_hashes([], PROMPT, 40)
    _evict_prompt(engine)
    events = engine.blocks.events.since(engine.blocks.events.epoch, 0).events
    kinds = {h: kind for _, kind, h in events}
    assert {kinds[h] for h in hashes} == {"demoted:host"}  # never "removed"
    tiered = dict(engine.blocks.kv_snapshot().tiered)
    assert all(tiered[h] == "host" for h in hashes)


def test_a_demotion_the_writer_cannot_keep_is_dropped(tiny_loaded, tmp_path):
    engine = _engine(tiny_loaded, tmp_path, host_tier_mb=4, host_tier_path=str(tmp_path / "shm"))
    _run(engine, PROMPT)
    host = engine.tiers.host
    for path in host.directory.iterdir():
        path.unlink()
    host.directory.rmdir()  # every write fails from now on
    _evict_prompt(engine)
    events = engine.blocks.events.since(engine.blocks.events.epoch, 0).events
    assert {kind for _, kind, _ in events} >= {"demoted:host", "dropped:host"}
    assert host.stats.failed_writes >= 10


def test_an_idle_worker_copies_what_it_computed_to_the_shared_tier(tiny_loaded, tmp_path):
    shared = {"host_tier_mb": 4, "host_tier_path": str(tmp_path / "shm")}
    engine = _engine(tiny_loaded, tmp_path, **shared)
    computed, _ = _run(engine, PROMPT)
    assert engine.checkpoint_tiers() >= 10 and engine.checkpoint_tiers() == 0
    engine.tiers.flush()  # the worker dies with every block still in its cache
    assert _run(_engine(tiny_loaded, tmp_path, **shared), PROMPT) == (computed, 40)
