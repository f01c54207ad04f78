"""Same-host page buffers in ``/dev/shm`` for the ZMQ transport.

When sender and receiver share a host, the sender copies the pages into its own shared-memory
file and sends only the header; the receiver maps that file and installs the pages straight from
it. This saves the socket's two kernel copies and the receive copy. A sender owns one file per
receiver endpoint and reuses it (a bigger transfer replaces it with a bigger file); transfers to
one endpoint are serialised, so the file is never rewritten before the acknowledgement. A file
is reserved in full when created: with ``/dev/shm`` too small for it, the sender sends frames.

Nothing is left in ``/dev/shm`` when a process is killed: the receiver unlinks a file as soon as
it has mapped it (both mappings stay valid; the memory goes when both are gone), and a sender
removes files of processes that no longer exist when it creates its first file.
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
import warnings
from collections import OrderedDict
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
_COUNTER = itertools.count()
_STALE_CHECK = iter([True])  # once per process


def _remove_stale_files() -> None:
    for path in SHM_DIR.glob("pdserve-kv-*"):
        try:
            pid = int(path.name.split("-")[2])
            if pid != os.getpid():
                os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, IndexError, PermissionError):
            continue


class SharedPageBuffer:
    """A sender's writable shared-memory file."""

    def __init__(self, num_bytes: int) -> None:
        if next(_STALE_CHECK, None) is not None:
            _remove_stale_files()
        self.path = SHM_DIR / f"pdserve-kv-{os.getpid()}-{next(_COUNTER)}"
        self.num_bytes = num_bytes
        with open(self.path, "w+b") as file:
            try:  # reserved now: a full /dev/shm is an OSError here, not a SIGBUS on write
                os.posix_fallocate(file.fileno(), 0, num_bytes)
            except OSError:
                self.path.unlink(missing_ok=True)
                raise
            self._map = mmap.mmap(file.fileno(), num_bytes)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.is_mapped_by_receiver = False
        atexit.register(self.close)

    def write(self, pages: torch.Tensor) -> None:
        self.tensor[: pages.numel() * pages.element_size()].copy_(pages.view(torch.uint8).flatten())

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


class SharedPageReader:
    """The receiver's read-only mappings of senders' files, most recently used kept."""

    def __init__(self, max_open: int = 16) -> None:
        self._maps: OrderedDict[str, tuple[mmap.mmap, torch.Tensor]] = OrderedDict()
        self._max_open = max_open

    def view(self, path: str, num_bytes: int) -> torch.Tensor:
        """The first ``num_bytes`` of ``path`` as a uint8 tensor (raises OSError if unreachable)."""
        if not path.startswith(str(SHM_DIR) + "/pdserve-kv-"):
            raise OSError(f"refusing to map {path!r}")
        entry = self._maps.get(path)
        if entry is None or entry[1].numel() < num_bytes:
            with open(path, "rb") as file:
                mapping = mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ)
            os.unlink(path)  # mapped on both sides now: the name is no longer needed
            with warnings.catch_warnings():  # read-only on purpose: we never write to it
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.frombuffer(mapping, dtype=torch.uint8) if len(mapping) else None
            if tensor is None or tensor.numel() < num_bytes:
                raise OSError(f"{path} holds fewer than {num_bytes} bytes")
            entry = self._maps[path] = (mapping, tensor)
            while len(self._maps) > self._max_open:
                self._maps.popitem(last=False)
        self._maps.move_to_end(path)
        return entry[1][:num_bytes]
