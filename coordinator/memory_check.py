"""The coordinator's memory against its pod's: at start, the budget of buffered request bodies
(``request_limit.max_buffered_body_mb``) must fit in a quarter of the memory limit its cgroup
sets, since the bodies' decoded JSON, the tokenizers and everything else the coordinator holds
need the rest; and ``request_limit.max_requests`` requests in flight, at ``REQUEST_BYTES``
each, in half of it. No limit set (no cgroup, ``max``): nothing to check against."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

MIB = 1024 * 1024
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
BODY_SHARE = 4  # the body budget may take at most 1/BODY_SHARE of the memory limit
REQUEST_SHARE = 2  # requests in flight may take at most 1/REQUEST_SHARE of the memory limit
# a streamed request in flight, as the coordinator holds it (its connection, its request and
# run, its token stream): ~63 KiB measured with 1,000 streams of ~100-token prompts at once
REQUEST_BYTES = 64 * 1024
NO_LIMIT_BYTES = 1 << 60  # cgroup v1 reports "no limit" as a number near 2**63


def memory_limit_bytes(paths: Iterable[str] = CGROUP_LIMITS) -> int | None:
    """The memory limit of this process's cgroup (v2, else v1), None when there is none."""
    for path in paths:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < NO_LIMIT_BYTES:
            return int(text)
        return None
    return None


def check_body_budget(config: Any, limit_bytes: int | None) -> None:
    """A :class:`ConfigError` when ``request_limit.max_buffered_body_mb`` is over a quarter of
    ``limit_bytes`` (the pod's memory)."""
    if limit_bytes is None:
        return
    budget_mb = config["request_limit"]["max_buffered_body_mb"]
    most_mb = limit_bytes // BODY_SHARE // MIB
    why = f"a quarter of this pod's memory limit of {limit_bytes // MIB} MB"
    _at_most("request_limit.max_buffered_body_mb", budget_mb, most_mb, why)


def check_request_room(config: Any, limit_bytes: int | None) -> None:
    """A :class:`ConfigError` when ``request_limit.max_requests`` requests in flight, at
    ``REQUEST_BYTES`` each, would take over half of ``limit_bytes`` (the pod's memory)."""
    if limit_bytes is None:
        return
    max_requests = config["request_limit"]["max_requests"]
    most = limit_bytes // REQUEST_SHARE // REQUEST_BYTES
    why = (
        f"requests in flight at {REQUEST_BYTES // 1024} KiB each in half of this pod's memory "
        f"limit of {limit_bytes // MIB} MB"
    )
    _at_most("request_limit.max_requests", max_requests, most, why)


def _at_most(key: str, value: int, most: int, why: str) -> None:
    if value > most:
        raise ConfigError(f"{key} must be in [1, {most}] ({why}), but got {value}")
