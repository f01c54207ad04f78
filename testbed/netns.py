"""Several hosts on one Linux machine: network namespaces joined by a bridge, a test bed for a
cluster spread over hosts (root only).

A :class:`TestBed` makes a "switch" namespace holding a bridge, and one namespace per host, linked
to the bridge by a veth pair (``eth0`` on the host's side) with an address on a private subnet
that exists only inside these namespaces: the machine's own network never sees it. Each host
also gets a private ``/dev/shm`` (a tmpfs) and ``/tmp/ray`` (a directory of the bed's), held by
an anchor process in a mount namespace of the host's own, as separate machines have: a file one
host writes into ``/dev/shm`` is not there for another.

Processes run on a host through ``nsenter`` into its anchor's namespaces (:meth:`Host.popen`);
code of this process opens sockets on a host from a thread that entered the host's network
namespace (:meth:`Host.call`). Every name carries the prefix ``pdmh`` and the creating process's
pid: :meth:`TestBed.close` removes what the bed made (processes, namespaces, links), and
:func:`sweep` removes what a run that was killed left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

PREFIX = "pdmh"
SUBNET = "10.231.0"  # /24, private to the bed's namespaces
CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def available() -> str | None:
    """Why this machine cannot host a test bed (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"{PREFIX}probe{os.getpid()}"
    result = _ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"cannot create a network namespace: {result.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str  # head, prefill, decode, ...
    netns: str
    address: str
    switch_port: str  # the veth end on the bridge, in the switch namespace
    root: Path  # its private directories live here
    anchor: subprocess.Popen | None = field(default=None, repr=False)

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``args`` on this host (its network, /dev/shm and /tmp/ray)."""
        assert self.anchor is not None
        pid = str(self.anchor.pid)
        return subprocess.Popen(["nsenter", "-t", pid, "-n", "-m", "--", *args], **kwargs)

    def run(self, args: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        process = self.popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = process.communicate(timeout=timeout)
        return subprocess.CompletedProcess(args, process.returncode, out, "")

    def call(self, fn: Callable[[], T], timeout: float = 300) -> T:
        """``fn()`` in a thread inside this host's network: the sockets it opens are the host's."""
        result: dict[str, Any] = {}

        def inside() -> None:
            try:
                enter_netns(self.netns)
                result["value"] = fn()
            except BaseException as exc:  # re-raised in the caller's thread
                result["error"] = exc

        thread = threading.Thread(target=inside, name=f"in-{self.name}", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"{fn!r} on {self.name} did not return within {timeout} s")
        if "error" in result:
            raise result["error"]
        return result["value"]

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split()]

    def rx_bytes(self) -> int:
        """Bytes received on the host's ``eth0`` so far."""
        out = _ip("-n", self.netns, "-s", "-j", "link", "show", "dev", "eth0").stdout
        return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])

    def kill_all(self) -> None:
        """Every process on the host but its anchor: the host powered off."""
        anchor = self.anchor.pid if self.anchor else None
        for pid in self.pids():
            if pid != anchor:
                _kill(pid)


class TestBed:
    """Hosts ``names`` on one bridge; ``close`` (or the context manager) removes everything."""

    __test__ = False  # not a pytest class

    def __init__(self, names: tuple[str, ...], workdir: Path) -> None:
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-switch"
        self.workdir = workdir
        self.hosts: dict[str, Host] = {}
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for index, name in enumerate(names):
                self.hosts[name] = self._add_host(name, index)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TestBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def _add_host(self, name: str, index: int) -> Host:
        netns, port = f"{self.tag}-{name}", f"pm{os.getpid()}x{index}"
        host = Host(name, netns, f"{SUBNET}.{index + 1}", f"{port}s", self.workdir / name)
        _ip("netns", "add", netns)
        _ip("link", "add", port, "netns", netns, "type", "veth",
            "peer", "name", host.switch_port, "netns", self.switch)  # fmt: skip
        _ip("-n", self.switch, "link", "set", host.switch_port, "master", "br0", "up")
        _ip("-n", netns, "link", "set", port, "name", "eth0")
        _ip("-n", netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        _ip("-n", netns, "route", "add", "default", "dev", "eth0")  # a node IP for Ray to find
        host.anchor = self._anchor(host)
        return host

    def _anchor(self, host: Host) -> subprocess.Popen:
        """A process holding the host's mount namespace: private /dev/shm and /tmp/ray."""
        ray_dir = host.root / "ray"
        ray_dir.mkdir(parents=True, exist_ok=True)
        script = (
            "mount -t tmpfs -o size=2g,mode=1777 tmpfs /dev/shm && mkdir -p /tmp/ray && "
            f"mount --bind {ray_dir} /tmp/ray && echo ready && exec sleep infinity"
        )
        anchor = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, "unshare", "--mount", "--propagation",
             "private", "--", "sh", "-c", script],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert anchor.stdout is not None
        if anchor.stdout.readline().strip() != "ready":
            raise RuntimeError(f"host {host.name}: could not set up its mounts")
        return anchor

    def link(self, name: str, up: bool) -> None:
        """Plug ``name``'s cable in or pull it out (its port on the bridge)."""
        port = self.hosts[name].switch_port
        _ip("-n", self.switch, "link", "set", port, "up" if up else "down")

    def shape(self, rate: str = "10gbit", delay: str | None = None) -> None:
        """Every host's link capped at ``rate`` (tc tbf), with ``delay`` each way if given (tc
        netem, which some kernels lack: then a RuntimeError says so)."""
        for host in self.hosts.values():
            qdisc = ["tbf", "rate", rate, "burst", "1mb", "latency", "10ms"]
            if delay:
                qdisc = ["netem", "rate", rate, "delay", delay]
            result = subprocess.run(
                ["ip", "netns", "exec", host.netns, "tc", "qdisc", "replace", "dev", "eth0",
                 "root", *qdisc],
                capture_output=True, text=True,
            )  # fmt: skip
            if result.returncode != 0:
                raise RuntimeError(f"tc {qdisc[0]} on {host.name}: {result.stderr.strip()}")

    def close(self) -> None:
        for host in self.hosts.values():
            host.kill_all()
            if host.anchor is not None:
                _kill(host.anchor.pid)
                host.anchor.wait(timeout=10)
        _remove(self.tag)


def sweep() -> None:
    """Remove the namespaces (and their processes) of beds whose process is gone."""
    out = _ip("netns", "list", check=False).stdout
    tags = {m.group(1) for m in re.finditer(rf"^({PREFIX}(\d+))-", out, re.MULTILINE)}
    for tag in tags:
        if not Path(f"/proc/{tag.removeprefix(PREFIX)}").exists():
            _remove(tag)


def _remove(tag: str) -> None:
    """Kill every process in ``tag``'s namespaces, then delete them (veth pairs go with them)."""
    out = _ip("netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.startswith(f"{tag}-")]
    for netns in names:
        for pid in _ip("netns", "pids", netns, check=False).stdout.split():
            _kill(int(pid))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
        _ip("netns", "pids", n, check=False).stdout.strip() for n in names
    ):
        time.sleep(0.1)
    for netns in names:
        _ip("netns", "del", netns, check=False)


def enter_netns(netns: str) -> None:
    """Move the calling thread into network namespace ``netns``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns} failed")
    finally:
        os.close(fd)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result
