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

Nothing stays mapped longer than needed either: a sender's replaced or closed file is unmapped at
once (its name, if the receiver never unlinked it, goes then too, or when the buffer is garbage
collected, or at exit); a receiver keeps one mapping per sending process, the file that process
uses now, and at most ``max_open`` in all.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import warnings
import weakref
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
            self._map: mmap.mmap | None = mmap.mmap(file.fileno(), num_bytes)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)
        self.is_mapped_by_receiver = False
        # Unlinks the name at close, garbage collection or exit, without keeping self alive.
        self._unlink = weakref.finalize(self, self.path.unlink, missing_ok=True)

    @property
    def closed(self) -> bool:
        return self._map is None

    def write(self, pages: torch.Tensor) -> None:
        if self.tensor is None:
            raise ValueError(f"{self.path} is closed")
        self.tensor[: pages.numel() * pages.element_size()].copy_(pages.view(torch.uint8).flatten())

    def close(self) -> None:
        """Unlink the name and unmap the file (idempotent)."""
        self._unlink()
        mapping, self._map, self.tensor = self._map, None, None
        if mapping is not None:
            with contextlib.suppress(BufferError):  # a view still out: unmapped with the last one
                mapping.close()


class SharedPageReader:
    """The receiver's read-only mappings of senders' files: the newest file of each sending
    process (a sender replaces its file for this receiver only with a larger one), the most
    recently used ``max_open`` of them."""

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
            for superseded in [p for p in self._maps if _sender(p) == _sender(path)]:
                del self._maps[superseded]
            entry = self._maps[path] = (mapping, tensor)
            while len(self._maps) > self._max_open:
                self._maps.popitem(last=False)
        self._maps.move_to_end(path)
        return entry[1][:num_bytes]


def _sender(path: str) -> str:
    """The sending process's part of a file name: ``/dev/shm/pdserve-kv-<pid>``."""
    return path.rsplit("-", 1)[0]
