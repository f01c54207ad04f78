"""Tenants (``http_config.api_keys`` with ``tenant_isolation``): one key's requests never hit
another key's cached prefix, in the engine, in a decode worker's reservation, and in the
router's prefix index; probed through a real HTTP server whose cluster runs real tiny engines
in-process. With isolation off, every key shares one cache as before."""

from __future__ import annotations

import httpx
import pytest

from coordinator.api.tenants import Tenants, record_tenant
from coordinator.config.loader import defaults
from coordinator.server import Coordinator
from decode_worker.worker import DecodeWorker
from engine.config import KVTransferConfig
from engine.outputs import TokenEvent
from prefill_worker.worker import PrefillWorker
from tests.conftest import make_engine
from tests.support.block_checks import check_consistent
from tests.support.channel_reader import ChannelReader
from tests.support.coordinator_configs import config_with
from tests.support.inprocess_workers import _stop
from tests.support.router_polls import PROMPT_A, _poll, _queued, _router, _running
from tests.support.tenant_cluster import (
    DOORS,
    KEY_A,
    KEY_B,
    PARAMS,
    PROBE,
    PROBE_CACHED,
    SYSTEM,
    _cached,
    _config,
    _openai_cached,
    served,
)
from workers.contracts import GenerationRequest, HandoffResult, HandoffTarget


def test_a_tenant_id_is_a_keyed_hash_never_the_key():
    tenants = Tenants([KEY_A, KEY_B])
    a, b = (tenants._ids[key] for key in (KEY_A, KEY_B))
    assert a != b and len(a) == len(b) == 32
    assert KEY_A not in a and KEY_A.encode().hex() not in a
    assert Tenants([KEY_A])._ids[KEY_A] != a  # another coordinator's secret, another id
    assert (
        Tenants([KEY_A], secret=b"s" * 32)._ids[KEY_A]
        == Tenants([KEY_A], secret=b"s" * 32)._ids[KEY_A]
    )
    assert not Tenants([KEY_A, KEY_B], isolation=False) and not Tenants([])
    assert not Tenants([""])  # an empty key names no tenant


def test_a_tenant_never_hits_another_tenants_prefix_in_the_engine(tiny_loaded):
    engine = make_engine(tiny_loaded)
    assert _cached(engine, "a1", [*SYSTEM, 1], "tenant-a") == 0
    assert _cached(engine, "b1", [*SYSTEM, 2], "tenant-b") == 0  # A's six blocks: not B's
    assert _cached(engine, "a2", [*SYSTEM, 3], "tenant-a") == 24  # A's own: a hit
    assert _cached(engine, "b2", [*SYSTEM, 4], "tenant-b") == 24  # B's own, cached just now
    assert _cached(engine, "n1", [*SYSTEM, 5], "") == 0  # no tenant is a root of its own
    assert _cached(engine, "n2", [*SYSTEM, 6], "") == 24  # and shares as it always did
    check_consistent(engine.blocks)


def test_a_decode_reservation_shares_only_its_own_tenants_blocks(tiny_model_dir):
    transfer = KVTransferConfig("inprocess", transfer_timeout_s=5.0)
    prefill = PrefillWorker(_config(tiny_model_dir), transfer)
    decode = DecodeWorker(_config(tiny_model_dir), transfer)
    reader = ChannelReader(prefill, decode)
    try:

        def handoff(request_id: str, tenant: str) -> tuple[int, int]:
            request = GenerationRequest(request_id, [*SYSTEM, 1, 2], PARAMS, tenant=tenant)
            request = reader.request(request)
            reservation = decode.reserve(request)
            assert reservation.granted, reservation.reason
            target = HandoffTarget.from_reservation(reservation, PARAMS.max_new_tokens)
            assert prefill.prefill(request, target).accepted
            items = reader.items(prefill, request_id)
            assert isinstance(items[-1], HandoffResult) and items[-1].ok, items[-1]
            events = [i for i in items if isinstance(i, TokenEvent)]
            events += reader.items(decode, request_id)
            return reservation.num_cached_blocks, max(e.num_cached_tokens for e in events)

        assert handoff("a1", "tenant-a") == (0, 0)
        assert handoff("b1", "tenant-b") == (0, 0)  # neither side lends B what A sent
        assert handoff("a2", "tenant-a") == (6, 24)  # A's own: held on both sides
        # a migrated request keeps its tenant, and with it its own prefix
        continued = reader.request(
            GenerationRequest("b", SYSTEM, PARAMS, tenant="tenant-b").continued("b2", [1, 2])
        )
        assert continued.tenant == "tenant-b"
        assert decode.reserve(continued).num_cached_blocks == 6
        decode.abort("b2")
    finally:
        reader.close()
        _stop(prefill, decode)


def test_the_router_is_not_drawn_by_another_tenants_prefix():
    router = _router()
    assert router.choose(PROMPT_A, tenant="a") == (0, 0)
    _poll(router, prefill_0=_queued(10), decode_0=_running(2))  # busier, within the knobs
    # B's same prompt: A's history on pair 0 does not count for it; the least loaded wins
    assert router.choose(PROMPT_A, tenant="b") == (1, 1)
    _poll(router, prefill_0=_queued(10), decode_0=_running(2))
    assert router.choose(PROMPT_A, tenant="a") == (0, 0)  # A's own history still draws it
    _poll(router, prefill_1=_queued(10), decode_1=_running(2))
    assert router.choose(PROMPT_A, tenant="b") == (1, 1)  # and B's its own


def test_without_tenants_the_router_follows_any_prefix_as_before():
    router = _router()
    assert router.choose(PROMPT_A) == (0, 0)
    _poll(router, prefill_0=_queued(10), decode_0=_running(2))
    assert router.choose(PROMPT_A) == (0, 0)  # busier, but it holds the prefix


@pytest.mark.parametrize("door", list(DOORS))
@pytest.mark.parametrize("isolation", [True, False])
def test_two_keys_probing_each_others_prefix_over_http(tiny_model_dir, door, isolation):
    cached = DOORS[door]
    with served(tiny_model_dir, 1, isolation) as (url, _):
        assert cached(url, KEY_A) == 0
        # B sends A's prompt: with isolation it learns nothing; without, it sees A's prefix
        assert cached(url, KEY_B) == (0 if isolation else PROBE_CACHED)
        assert cached(url, KEY_A) == PROBE_CACHED  # the same key twice: its own hit
        assert cached(url, KEY_B) == PROBE_CACHED


def test_over_http_the_router_does_not_send_b_after_as_history(tiny_model_dir):
    with served(tiny_model_dir, 2, True) as (url, workers):

        def queried() -> list[int]:  # prompt tokens each worker looked up in its cache
            return [w.engine.blocks.num_queried_tokens for w in workers]

        assert _openai_cached(url, KEY_A) == 0
        assert queried() == [len(PROBE), 0]  # A's prompt went to worker 0
        assert _openai_cached(url, KEY_B) == 0
        assert queried() == [len(PROBE), len(PROBE)]  # B's went by load, not after A's prefix
        assert _openai_cached(url, KEY_A) == PROBE_CACHED
        assert queried() == [2 * len(PROBE), len(PROBE)]  # A's own history draws A back


def test_over_http_without_isolation_the_router_follows_any_keys_prefix(tiny_model_dir):
    with served(tiny_model_dir, 2, False) as (url, workers):
        assert _openai_cached(url, KEY_A) == 0
        assert _openai_cached(url, KEY_B) == PROBE_CACHED  # drawn to worker 0 by A's prefix
        assert workers[1].engine.blocks.num_queried_tokens == 0


def test_a_wrong_key_is_still_refused_before_the_tenant_gate(tiny_model_dir):
    with served(tiny_model_dir, 1, True) as (url, workers):
        body = {"model": "tiny", "prompt": PROBE}
        headers = {"Authorization": "Bearer not-a-key"}
        answer = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)
        assert answer.status_code == 401
        assert workers[0].engine.blocks.num_queried_tokens == 0


@pytest.mark.parametrize("isolation", [True, False])
def test_the_coordinator_takes_tenant_isolation_from_its_config(isolation):
    config = config_with(api_keys=[KEY_A, KEY_B], tenant_isolation=isolation)
    app = Coordinator(config).predict_app()
    gates = [m.kwargs["refuse"] for m in app.user_middleware if "refuse" in m.kwargs]
    tenants = next(gate.keywords["tenants"] for gate in gates if gate.func is record_tenant)
    assert bool(tenants) is isolation
    assert defaults()["http_config"]["tenant_isolation"] is True  # the default with keys
