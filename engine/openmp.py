"""One thread of a worker runs OpenMP teams: the engine's.

GNU OpenMP gives every thread that starts a parallel region a team of its own, and counts all
their threads together: once a process holds more of them than it has cores (two teams of two
threads on two cores), every team stops spinning at its barriers after about a hundred turns and
sleeps on a futex instead (libgomp's "throttled" spin count, whatever ``GOMP_SPINCOUNT`` says).
A decode step of the fused layers meets at ~150 barriers; sleeping and being woken at each, on
cores the coordinator and Ray share, left a served ``single_node`` worker's threads off their
cores for about a quarter of each step while the cores stood idle (in a profile; the
``served_stream`` benchmark's ``single_node`` rows show the rate and TPOT since). So a worker
builds its engine on the engine thread (model load and cache allocation run parallel regions
too), and any other thread that runs a tensor operation (a transport thread writing a
hand-off's pages) first calls :func:`serial_here`, so that its regions run on itself and no
second team is made.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
OPENMP_RUNTIMES = ("libgomp", "libiomp5", "libomp")  # GNU's (torch's wheels), Intel's, LLVM's


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime this process loaded (the one torch's operations use), None if none
    (or no ``/proc``: then nothing is changed)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    for line in maps.read_text().splitlines():
        path = line.split()[-1]
        if Path(path).name.startswith(OPENMP_RUNTIMES):
            return ctypes.CDLL(path)
    return None


_serial = threading.local()


def serial_here() -> None:
    """Parallel regions started from the calling thread from now on run on it alone (its own
    OpenMP thread count, not the process's; other threads keep theirs)."""
    if getattr(_serial, "done", False):
        return
    import torch  # loaded by the engine already; a module that only names this one need not

    torch.get_num_threads()  # torch sets a thread's count the first time it asks: before us
    runtime = _openmp_runtime()
    if runtime is not None:
        runtime.omp_set_num_threads(1)
    _serial.done = True


def start_building(
    build: Callable[[], T], run: Callable[[T], None], name: str
) -> tuple[T, threading.Thread]:
    """Start a daemon thread ``name`` that builds with ``build`` (a model's load runs parallel
    regions: on the thread that will run the model's) and then calls ``run`` with what it built;
    return that, once built, and the thread. ``build``'s error, if it fails, is raised here."""
    built: Future[T] = Future()

    def main() -> None:
        try:
            made = build()
        except BaseException as exc:  # raised by the caller
            built.set_exception(exc)
            return
        built.set_result(made)
        run(made)

    thread = threading.Thread(target=main, name=name, daemon=True)
    thread.start()
    return built.result(), thread
