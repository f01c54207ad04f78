"""The worker's C heap keeper (``workers/heap.py``): figures that see an allocation and its free,
a trim that hands free pages back (RSS falls), the periods it keeps, and no trims when off."""

from __future__ import annotations

import psutil
import pytest

from workers.heap import FIGURES_PERIOD_S, HeapKeeper

MIB = 1 << 20
pytestmark = pytest.mark.skipif(not HeapKeeper().available, reason="glibc's mallinfo2 only")


def test_figures_tell_bytes_in_use_from_free_bytes_held():
    """~50 MB of small chunks count as in use, then, freed below a pin (so the heap's top cannot
    shrink them away), as free: whether the process's heap lent them from its free chunks or
    grew for them."""
    keeper = HeapKeeper(trim_period_s=0, now=0.0)
    keeper.tick(0.0)
    before = keeper.figures
    chunks = [bytearray(1000) for _ in range(50_000)]
    pin = [bytearray(16) for _ in range(8)]
    keeper.tick(FIGURES_PERIOD_S)
    held = keeper.figures
    assert held.in_use_bytes - before.in_use_bytes > 40 * MIB
    del chunks
    keeper.tick(2 * FIGURES_PERIOD_S)
    freed = keeper.figures
    assert held.in_use_bytes - freed.in_use_bytes > 40 * MIB
    assert freed.free_bytes - held.free_bytes > 40 * MIB
    assert freed.trims == 0
    del pin


def test_figures_wait_for_their_period():
    keeper = HeapKeeper(trim_period_s=0, now=0.0)
    keeper.tick(0.0)
    first = keeper.figures
    chunks = [bytearray(1000) for _ in range(20_000)]
    keeper.tick(FIGURES_PERIOD_S / 2)
    assert keeper.figures == first
    del chunks


def test_a_trim_gives_free_pages_back():
    process = psutil.Process()
    keeper = HeapKeeper(trim_period_s=60, now=0.0)
    keeper.tick(0.0)
    chunks = [bytearray(1000) for _ in range(60_000)]
    pin = [bytearray(16) for _ in range(8)]  # above the freed chunks: no plain top trim
    del chunks
    resident = process.memory_info().rss
    keeper.tick(30.0)
    assert keeper.figures.trims == 0  # not yet its time
    keeper.tick(10_000.0)
    assert keeper.figures.trims == 1 and keeper.figures.last_trim_ms >= 0
    assert resident - process.memory_info().rss > 30 * MIB
    del pin


def test_the_heap_figures_reach_instances_and_metrics():
    """A worker's load carries its heap figures to ``/v1/instances`` (flat JSON) and to the
    coordinator's gauges."""
    from coordinator.metrics import Metrics
    from engine.outputs import EngineStats
    from workers.contracts import WorkerIdentity, WorkerLoad
    from workers.heap import HeapFigures

    heap = HeapFigures(in_use_bytes=5 * MIB, free_bytes=MIB, trims=3, last_trim_ms=1.5)
    load = WorkerLoad("decode", 0, 42, EngineStats(), heap=heap)
    row = load.to_dict(WorkerIdentity("decode", 0, 42))
    assert (row["heap_in_use_bytes"], row["heap_free_bytes"]) == (5 * MIB, MIB)
    assert (row["heap_trims"], row["heap_last_trim_ms"]) == (3, 1.5)
    metrics = Metrics("m")
    metrics.record_loads([load])
    labels = {"model_name": "m", "role": "decode", "instance": "0"}
    assert metrics.registry.get_sample_value("worker_heap_in_use_bytes", labels) == 5 * MIB
    assert metrics.registry.get_sample_value("worker_heap_free_bytes", labels) == MIB
