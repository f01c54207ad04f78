"""Which Ray node a coordinator joining a cluster attaches to, where one host shows several.

A driver joining a cluster (``ray.init(address="HOST:PORT")``) attaches to a raylet it finds by
listing this machine's processes, and prefers the head's when it sees more than one. Where hosts
share a process table but not a network (containers with a shared PID namespace, network
namespaces, several nodes on one machine), that can be another host's raylet: the driver then
advertises that node's address, and everything a worker sends back to it unasked (the results of
its calls) goes to an address where nothing listens. So when this machine
shows several raylets, and one of them has the address this host reaches the cluster's GCS
from, that one is named to ``ray.init``. Otherwise Ray chooses as it always has.
"""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

RAYLET_IP_FLAG = "--node_ip_address="


def own_node_ip(address: str) -> str | None:
    """The address of this host's own raylet to attach to for the cluster at ``address``
    (HOST:PORT), or None: let Ray choose (one raylet or none visible, none of them this host's,
    or an address of another form: ``auto``, ``ray://``)."""
    visible = set(raylet_ips())
    if len(visible) < 2:
        return None
    source = route_source(address)
    return source if source in visible else None


def route_source(address: str) -> str | None:
    """The local address that packets to ``address`` (HOST:PORT) leave from (no packet sent)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return None
    host = host.strip("[]")
    with contextlib.suppress(OSError, UnicodeError):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(port)))
            return str(probe.getsockname()[0])
    return None


def raylet_ips(proc: Path = Path("/proc")) -> list[str]:
    """``--node_ip_address`` of every raylet process this machine shows (Linux ``/proc``)."""
    found = []
    for cmdline in proc.glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if not args or not args[0].endswith(b"/raylet"):
            continue
        for arg in args[1:]:
            text = arg.decode(errors="replace")
            if text.startswith(RAYLET_IP_FLAG):
                found.append(text.removeprefix(RAYLET_IP_FLAG))
    return found
