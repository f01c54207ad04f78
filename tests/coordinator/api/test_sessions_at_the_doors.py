"""Sessions at the doors: OpenAI's ``prompt_cache_key`` and the ``X-Prompt-Cache-Key`` header reach
the worker (as a hash of the key), whose engine then keeps the conversation's blocks longer;
a request naming none keeps nothing longer."""

from __future__ import annotations

import httpx

from coordinator.api.common import session_key
from tests.support.tenant_cluster import KEY_A, PROBE, served


def _kept(worker) -> int:
    """Blocks the worker's engine keeps for sessions."""
    return worker.loop.call(lambda engine: len(engine.blocks._preferred)).result()


def test_a_conversations_key_keeps_its_blocks_at_every_door(tiny_model_dir):
    with served(tiny_model_dir, 1, tenant_isolation=True) as (url, workers):
        auth = {"Authorization": f"Bearer {KEY_A}"}
        plain = {"model": "tiny", "prompt": PROBE, "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=plain, headers=auth).status_code == 200
        assert _kept(workers[0]) == 0
        body = {**plain, "prompt_cache_key": "conversation-1"}
        assert httpx.post(f"{url}/v1/completions", json=body, headers=auth).status_code == 200
        kept = _kept(workers[0])
        assert kept > 0
        infer = {"inputs": PROBE + " and more of it", "parameters": {"max_new_tokens": 2}}
        headers = {"api-key": KEY_A, "X-Prompt-Cache-Key": "conversation-2"}
        assert httpx.post(f"{url}/infer", json=infer, headers=headers).status_code == 200
        assert _kept(workers[0]) > kept


def test_a_key_reaches_the_workers_as_a_hash():
    assert session_key("") == ""
    assert len(session_key("conversation")) == 32 and "conversation" not in session_key(
        "conversation"
    )
