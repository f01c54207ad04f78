"""One thread of a worker runs OpenMP teams (engine/openmp.py): another thread's tensor
operations, after ``serial_here``, make no team; the engine is built on the engine thread."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from engine.engine_loop import EngineLoop
from engine.openmp import serial_here

BIG = 1 << 22  # elements: far above torch's grain size, so an add runs a parallel region


def _threads() -> set[str]:
    return {task.name for task in Path("/proc/self/task").iterdir()}


def _new_threads_of_an_add(serial: bool) -> tuple[int, int]:
    """In a fresh thread: how many threads a big add started (the thread's OpenMP team; threads
    that ended meanwhile do not count), and that thread's torch thread count."""
    out: list[int] = []

    def work() -> None:
        if serial:
            serial_here()
        before = _threads()
        x = torch.ones(BIG)
        torch.add(x, x)
        out.extend([len(_threads() - before), torch.get_num_threads()])

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return out[0], out[1]


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def test_a_thread_made_serial_adds_no_team_while_another_thread_does(two_threads):
    gained, count = _new_threads_of_an_add(serial=False)
    assert (gained, count) == (1, 2)  # the measure sees a team: a thread of its own
    gained, count = _new_threads_of_an_add(serial=True)
    assert (gained, count) == (0, 1)
    assert torch.get_num_threads() == 2  # the calling thread keeps its count


class _NoHooks:
    def on_events(self, events: list) -> None:
        pass

    def on_housekeeping(self) -> None:
        pass


def test_the_engine_is_built_on_the_engine_thread_and_its_error_reaches_the_caller():
    built_on: list[str] = []

    class Importer:
        def expire_reservations(self, now: float) -> None:
            pass

    class Engine:
        importer = Importer()

        def has_work(self) -> bool:
            return False

        def stats(self) -> None:
            return None

    def build() -> Engine:
        built_on.append(threading.current_thread().name)
        return Engine()

    loop = EngineLoop(build, _NoHooks())  # type: ignore[arg-type]
    try:
        assert built_on == ["engine-loop"]
        assert isinstance(loop.engine, Engine)
    finally:
        loop.stop()

    def fail() -> Engine:
        raise RuntimeError("no model here")

    with pytest.raises(RuntimeError, match="no model here"):
        EngineLoop(fail, _NoHooks())  # type: ignore[arg-type]
