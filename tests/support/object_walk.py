"""Find a request anywhere in an object graph: every attribute, dict, list, set and tuple
reachable from a root, so that a table added later that forgets a request is caught too."""

from __future__ import annotations

import queue
import threading
import types
from collections.abc import Iterator
from typing import Any

# what is walked past: code, locks and threads, and the tensors of a model or KV cache
_OPAQUE = (types.ModuleType, types.FunctionType, type, threading.Thread, queue.Queue)


def paths_naming(root: Any, needle: str, max_depth: int = 12) -> list[str]:
    """The paths (``.attr``, ``[key]``) from ``root`` to every string equal to ``needle`` or
    containing it (an id inside a longer key), and to every object whose ``request_id`` is it."""
    found: list[str] = []
    seen: set[int] = set()
    for path, value in _walk(root, "", seen, max_depth):
        if (
            isinstance(value, str)
            and needle in value
            or getattr(value, "request_id", None) == needle
        ):
            found.append(path)
    return found


def _walk(value: Any, path: str, seen: set[int], depth: int) -> Iterator[tuple[str, Any]]:
    yield path, value
    if depth == 0 or id(value) in seen or isinstance(value, str | bytes | int | float | bool):
        return
    seen.add(id(value))
    for key, child in _children(value):
        yield from _walk(child, f"{path}{key}", seen, depth - 1)


def _children(value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, _OPAQUE) or type(value).__module__.startswith(("torch", "zmq", "grpc")):
        return
    if isinstance(value, dict):
        for key, child in list(value.items()):
            yield f"[{key!r}]", key
            yield f"[{key!r}]", child
    elif isinstance(value, list | tuple | set | frozenset):
        for i, child in enumerate(list(value)):
            yield f"[{i}]", child
    else:
        attributes = getattr(value, "__dict__", None)
        if isinstance(attributes, dict):
            for name, child in list(attributes.items()):
                yield f".{name}", child
        for name in getattr(type(value), "__slots__", ()):
            if hasattr(value, name):
                yield f".{name}", getattr(value, name)
