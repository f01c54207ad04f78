"""``coordinator/ray_node.py``: a coordinator joining a cluster names its own host's raylet to Ray
where the machine shows several (as the multi-host test bed's hosts do), and leaves the choice to
Ray otherwise. The real thing runs in ``tests/multihost/test_replicas_across_hosts.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator import ray_node


def fake_proc(root: Path, commands: list[list[str]]) -> Path:
    for pid, args in enumerate(commands, start=100):
        (root / str(pid)).mkdir()
        (root / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in args) + b"\0")
    (root / "self").mkdir()  # not a pid: skipped
    return root


def raylet(ip: str) -> list[str]:
    return [
        "/venv/ray/core/src/ray/raylet/raylet",
        "--raylet_socket_name=x",
        f"--node_ip_address={ip}",
    ]


def test_raylet_addresses_come_from_raylet_processes_only(tmp_path):
    proc = fake_proc(
        tmp_path,
        [raylet("10.0.0.1"), ["python", "--node_ip_address=10.9.9.9"], raylet("10.0.0.2")],
    )
    assert sorted(ray_node.raylet_ips(proc)) == ["10.0.0.1", "10.0.0.2"]


def test_the_route_source_is_the_local_address_toward_the_gcs():
    assert ray_node.route_source("127.0.0.1:6379") == "127.0.0.1"
    for other_form in ("auto", "ray://127.0.0.1:10001", "127.0.0.1", "host:port", ""):
        assert ray_node.route_source(other_form) is None


@pytest.mark.parametrize(
    ("visible", "source", "chosen"),
    [
        (["10.0.0.1", "10.0.0.2"], "10.0.0.2", "10.0.0.2"),  # several: this host's own
        (["10.0.0.1", "10.0.0.2"], "10.0.0.7", None),  # none of them this host's: Ray's choice
        (["10.0.0.2"], "10.0.0.2", None),  # one raylet: nothing to choose
        ([], None, None),
    ],
)
def test_own_node_ip_only_where_there_is_a_choice(monkeypatch, visible, source, chosen):
    monkeypatch.setattr(ray_node, "raylet_ips", lambda: visible)
    monkeypatch.setattr(ray_node, "route_source", lambda address: source)
    assert ray_node.own_node_ip("10.0.0.1:6379") == chosen


def test_an_unresolvable_gcs_address_is_no_error():
    assert ray_node.route_source("no-such-host.invalid:6379") is None
