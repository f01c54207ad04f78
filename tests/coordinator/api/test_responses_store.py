"""The bounded store of ``/v1/responses``: a response lives its TTL, a tenant keeps at most its
count and bytes (the oldest go first), all tenants together at most the total, and a tenant
never reads or deletes another's."""

from __future__ import annotations

import time

from coordinator.api.responses_store import ResponseStore


def _response(n: int, text: str = "x") -> dict:
    return {"id": f"resp_{n}", "output": [text]}


def test_a_tenant_reads_its_own_and_never_anothers():
    store = ResponseStore()
    assert store.put("a", _response(1), [{"type": "message"}])
    assert store.get("a", "resp_1").conversation == [{"type": "message"}]
    assert store.get("b", "resp_1") is None and not store.delete("b", "resp_1")
    assert store.delete("a", "resp_1") and store.get("a", "resp_1") is None


def test_the_oldest_go_first_past_a_tenants_count_and_bytes():
    store = ResponseStore(max_per_tenant=3)
    for n in range(5):
        store.put("a", _response(n), [])
    store.put("b", _response(9), [])
    assert [n for n in range(5) if store.get("a", f"resp_{n}")] == [2, 3, 4]
    assert store.get("b", "resp_9") is not None  # another tenant's count is its own
    small = ResponseStore(max_tenant_bytes=300)
    for n in range(6):
        small.put("a", _response(n, "y" * 80), [])
    assert small.num_bytes <= 300 and small.get("a", "resp_5") is not None
    assert not small.put("a", _response(7, "z" * 400), [])  # alone over the bound: not kept


def test_all_tenants_together_stay_under_the_total():
    store = ResponseStore(max_bytes=1000)
    for n in range(40):
        store.put(f"t{n}", _response(n, "w" * 50), [])
    assert store.num_bytes <= 1000 and store.get("t39", "resp_39") is not None
    assert store.get("t0", "resp_0") is None


def test_a_response_lives_its_ttl():
    store = ResponseStore(ttl_s=0.05)
    store.put("a", _response(1), [])
    time.sleep(0.1)
    assert store.get("a", "resp_1") is None and len(store) == 0 and store.num_bytes == 0
