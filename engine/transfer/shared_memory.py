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

Nothing on the wire can make a receiver open anything else: the header carries only a file's
name, which must match ``NAME_PATTERN`` (the sender's pid and 128 random bits), and the receiver
builds the path in ``/dev/shm`` itself. It opens the file without following links and without
blocking (a FIFO), and maps it only if it is a regular file of this user holding the pages. A
sender creates its files new (``O_EXCL``, never through a link), readable by this user only.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import stat
import warnings
import weakref
from collections import OrderedDict
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "pdserve-kv-"
# The only names a receiver opens: ours, made by ``new_name``; never a path.
NAME_PATTERN = re.compile(r"pdserve-kv-[0-9]{1,10}-[0-9a-f]{32}\Z")
_STALE_CHECK = iter([True])  # once per process


def new_name() -> str:
    """A fresh file name: the sending process, then 128 random bits (never guessed ahead)."""
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(16)}"


def _remove_stale_files() -> None:
    for path in SHM_DIR.glob(PREFIX + "*"):
        try:
            pid = int(path.name.split("-")[2])
            if path.lstat().st_uid != os.getuid():
                continue
            if pid != os.getpid():
                os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, IndexError, OSError):
            continue


class SharedPageBuffer:
    """A sender's writable shared-memory file: created new (never an existing file or link),
    readable by this user only, and reserved in full."""

    def __init__(self, num_bytes: int) -> None:
        if next(_STALE_CHECK, None) is not None:
            _remove_stale_files()
        self.name = new_name()
        self.path = SHM_DIR / self.name
        self.num_bytes = num_bytes
        flags = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR
        fd = os.open(self.path, flags, 0o600)
        try:  # reserved now: a full /dev/shm is an OSError here, not a SIGBUS on write
            os.posix_fallocate(fd, 0, num_bytes)
            self._map: mmap.mmap | None = mmap.mmap(fd, num_bytes)
        except (OSError, ValueError):
            self.path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)
        self.is_mapped_by_receiver = False
        # Unlinks the name at close, garbage collection or exit, without keeping self alive.
        self._unlink = weakref.finalize(self, self.path.unlink, missing_ok=True)

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

    def view(self, name: str, num_bytes: int) -> torch.Tensor:
        """The first ``num_bytes`` of the sender's file ``name`` as a uint8 tensor. Raises
        OSError for a name not of ours, or a file that is not a regular file of this user at
        least that large (a link, a FIFO, a device, a short file)."""
        if not NAME_PATTERN.match(name):
            raise OSError("not a shared-memory file name of this service")
        entry = self._maps.get(name)
        if entry is None or entry[1].numel() < num_bytes:
            mapping = _map_read_only(SHM_DIR / name, num_bytes)
            with warnings.catch_warnings():  # read-only on purpose: we never write to it
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.frombuffer(mapping, dtype=torch.uint8)
            for superseded in [n for n in self._maps if _sender(n) == _sender(name)]:
                del self._maps[superseded]
            entry = self._maps[name] = (mapping, tensor)
            while len(self._maps) > self._max_open:
                self._maps.popitem(last=False)
        self._maps.move_to_end(name)
        return entry[1][:num_bytes]


def _map_read_only(path: Path, num_bytes: int) -> mmap.mmap:
    """Map ``path`` read-only once it proved a regular file of ours, of at least ``num_bytes``
    bytes; its name is unlinked then (mapped on both sides, it is no longer needed)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise OSError("not a regular file of this user")
        if info.st_size < max(num_bytes, 1):
            raise OSError(f"holds {info.st_size} bytes, fewer than {num_bytes}")
        mapping = mmap.mmap(fd, info.st_size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    os.unlink(path)
    return mapping


def _sender(name: str) -> str:
    """The sending process's part of a file name: ``pdserve-kv-<pid>``."""
    return name.rsplit("-", 1)[0]
