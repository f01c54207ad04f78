"""A streamed event's bytes: ``<prefix><compact JSON>\\n\\n``, the JSON encoded once, straight to
UTF-8 bytes by orjson (every door's per-token framing goes through :func:`sse_event`).

orjson writes what ``json.dumps(value, ensure_ascii=False, separators=(",", ":"))`` writes for
the values a stream carries (strings, ints, floats, None, lists, dicts with string keys);
``benchmarks/serving/door_framing.py`` measures each door's cost per event with it and with the
standard library's encoder (``docs/performance/serving.md``: the figures)."""

from __future__ import annotations

from typing import Any

import orjson

DATA = b"data: "  # MindIE, OpenAI, Azure
DATA_NO_SPACE = b"data:"  # TGI writes its events with no space


def dumps(value: Any) -> bytes:
    """Compact JSON, UTF-8 kept as is (no ``\\u`` escapes for non-ASCII text); numpy scalars and
    subclasses of float (which ``json`` writes as numbers) are written as numbers too."""
    return orjson.dumps(value, default=_plain, option=orjson.OPT_SERIALIZE_NUMPY)


def _plain(value: Any) -> Any:
    """What orjson does not write itself: a float subclass, or a numpy value, as a number."""
    if isinstance(value, float):
        return float(value)
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def sse_event(payload: Any, prefix: bytes = DATA) -> bytes:
    """One server-sent event carrying ``payload``."""
    return prefix + dumps(payload) + b"\n\n"


def named_event(name: str, payload: Any) -> bytes:
    """One server-sent event named ``name`` (``event: <name>``) carrying ``payload``, as the
    Anthropic Messages and OpenAI Responses streams write each event."""
    return b"event: " + name.encode() + b"\n" + DATA + dumps(payload) + b"\n\n"
