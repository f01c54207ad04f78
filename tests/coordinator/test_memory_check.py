"""The body budget and the requests in flight against the pod's memory at start: read from
cgroup v2, else v1, none when unlimited or absent; a budget over a quarter of the limit, or more
requests than fit in half of it, stops start-up, naming the key, its range and the value."""

from __future__ import annotations

import pytest

from coordinator.memory_check import check_body_budget, check_request_room, memory_limit_bytes
from engine.errors import ConfigError

GIB = 1 << 30


def limit_file(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text + "\n")
    return str(path)


def test_the_limit_comes_from_the_first_cgroup_file_there(tmp_path):
    v2 = limit_file(tmp_path, "memory.max", str(4 * GIB))
    v1 = limit_file(tmp_path, "memory.limit_in_bytes", str(GIB))
    assert memory_limit_bytes([str(tmp_path / "absent"), v2, v1]) == 4 * GIB
    assert memory_limit_bytes([str(tmp_path / "absent"), v1]) == GIB


@pytest.mark.parametrize("text", ["max", "9223372036854771712"])
def test_an_unlimited_cgroup_is_no_limit(tmp_path, text):
    assert memory_limit_bytes([limit_file(tmp_path, "memory.max", text)]) is None


def test_no_cgroup_is_no_limit(tmp_path):
    assert memory_limit_bytes([str(tmp_path / "absent")]) is None


def config(budget_mb: int) -> dict:
    return {"request_limit": {"max_buffered_body_mb": budget_mb}}


def test_a_budget_over_a_quarter_of_the_pods_memory_stops_start_up():
    check_body_budget(config(1024), 4 * GIB)
    check_body_budget(config(10**6), None)
    with pytest.raises(ConfigError) as refused:
        check_body_budget(config(1025), 4 * GIB)
    assert str(refused.value) == (
        "request_limit.max_buffered_body_mb must be in [1, 1024] (a quarter of this pod's memory "
        "limit of 4096 MB), but got 1025"
    )


def test_more_requests_in_flight_than_half_the_pods_memory_holds_stop_start_up():
    def requests(count: int) -> dict:
        return {"request_limit": {"max_requests": count}}

    check_request_room(requests(10_000), 4 * GIB)  # the default in the chart's 4 Gi pod
    check_request_room(requests(10**9), None)
    with pytest.raises(ConfigError) as refused:
        check_request_room(requests(8193), GIB)
    assert str(refused.value) == (
        "request_limit.max_requests must be in [1, 8192] (requests in flight at 64 KiB each in "
        "half of this pod's memory limit of 1024 MB), but got 8193"
    )
