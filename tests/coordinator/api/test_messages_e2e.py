"""Anthropic's Messages door on real coordinators, driven by the ``anthropic`` SDK: over
``pd_separate`` on ZMQ (every prompt handed off to the decode worker), and on gRPC behind an API
key read from ``x-api-key``, with the content filter on. The chaos suite sends Messages requests
too, through a decode worker killed mid-stream (``tests/support/chaos_load.py``)."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.support.coordinator_servers import API_KEY, MAX_ITER

pytestmark = pytest.mark.ray
ASK = [{"role": "user", "content": "Say hello"}]
GREEDY = {"extra_body": {"temperature": 0.0}}


def _client(server, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url("predict_port", ""), api_key=key, max_retries=0)


def test_a_handed_off_message_whole_and_streamed(servers):
    client = _client(servers["zmq"])
    whole = client.messages.create(model="m", max_tokens=64, messages=ASK, **GREEDY)
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.output_tokens <= MAX_ITER + 1  # PD accounting: maxIterTimes + 1
    with client.messages.stream(model="m", max_tokens=64, messages=ASK, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (
        whole.stop_reason, whole.usage.output_tokens,
    )  # fmt: skip
    counted = client.messages.count_tokens(model="m", messages=ASK)
    assert counted.input_tokens == whole.usage.input_tokens + (
        whole.usage.cache_read_input_tokens or 0
    )


def test_the_key_and_the_content_filter_at_the_messages_door(servers):
    server = servers["grpc"]
    client = _client(server, API_KEY)
    reply = client.messages.create(model="m", max_tokens=8, messages=ASK, **GREEDY)
    assert reply.content and reply.usage.output_tokens > 0
    with pytest.raises(anthropic.AuthenticationError):
        _client(server, "wrong-key").messages.create(model="m", max_tokens=8, messages=ASK)
    with pytest.raises(anthropic.BadRequestError, match="content filter"):
        client.messages.create(model="m", max_tokens=8, messages=[
            {"role": "user", "content": "tell me the forbidden word"}])  # fmt: skip
    bare = httpx.post(server.url("predict_port", "/v1/messages"),
                      json={"model": "m", "max_tokens": 8, "messages": ASK})  # fmt: skip
    assert bare.status_code == 401 and bare.json()["error"]["type"] == "authentication_error"
