"""Whether a cached kernel build may be imported: importing a library runs its code, so only one
that no other user could have put or changed there is loaded.

A build folder is trusted when it is a real directory owned by this process's user and writable
by no one else; the library its ``ready`` file names must be a plain file name (no path
separator, no ``..``) that resolves to a file directly inside that folder, with the same owner and
the same modes. Anything else is rebuilt (``engine.kernels``), with a warning saying why.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH


def untrusted_reason(folder: Path, library_name: str) -> str | None:
    """Why the library ``library_name`` of build ``folder`` must not be imported, in words, or
    None when it may be."""
    if not library_name or library_name in (".", "..") or ".." in library_name:
        return f"the ready file names {library_name!r}, not a library file name"
    if any(sep and sep in library_name for sep in (os.sep, os.altsep, "/")):
        return f"the ready file names {library_name!r}, a path rather than a file of the folder"
    problem = _owned_and_private(folder, "build folder", stat.S_ISDIR)
    if problem:
        return problem
    library = folder / library_name
    if library.resolve().parent != folder.resolve():
        return f"{library} resolves to {library.resolve()}, outside its build folder"
    return _owned_and_private(library, "library", stat.S_ISREG)


def make_private(path: Path) -> None:
    """Drop group and world write from ``path`` (one this process's user owns), so a build it
    just made passes :func:`untrusted_reason` whatever the umask."""
    mode = path.stat().st_mode
    if mode & SHARED_WRITE:
        path.chmod(stat.S_IMODE(mode) & ~SHARED_WRITE)


def _owned_and_private(path: Path, what: str, is_kind: Callable[[int], bool]) -> str | None:
    """Why ``path`` (not followed if a link) is not ``is_kind``, owned by this user and writable
    by no one else; None when it is."""
    try:
        info = path.lstat()
    except OSError as exc:
        return f"the {what} {path} cannot be read ({exc.strerror})"
    if not is_kind(info.st_mode):
        return f"the {what} {path} is a link or another kind of file"
    if info.st_uid != os.geteuid():
        return f"the {what} {path} is owned by uid {info.st_uid}, not this user ({os.geteuid()})"
    if info.st_mode & SHARED_WRITE:
        mode = oct(stat.S_IMODE(info.st_mode))
        return f"the {what} {path} is writable by its group or by everyone (mode {mode})"
    return None
