"""Log probabilities at the OpenAI and TGI doors, read by the real ``openai`` and
``text-generation`` clients: the predict app runs
in process under uvicorn over the tiny model (its engine stepped in process). Chat's ``logprobs``
and ``top_logprobs``, completions' ``logprobs``: one entry a token, whole and streamed alike;
out-of-range values are 400 naming the field."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import text_generation

from tests.conftest import make_engine
from tests.support.door_fakes import engine_door

ASK = [{"role": "user", "content": "Say something"}]
GREEDY = {"model": "tiny", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def door(tiny_loaded) -> Iterator[str]:
    with engine_door(make_engine(tiny_loaded, num_blocks=512)) as (url, _):
        yield url


@pytest.fixture
def client(door) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{door}/v1", api_key="none", max_retries=0)


def test_chat_logprobs_whole_and_streamed(client):
    whole = client.chat.completions.create(messages=ASK, logprobs=True, top_logprobs=5, **GREEDY)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens > 0
    for entry in content:
        assert len(entry.top_logprobs) == 5 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token  # greedy: the best one was taken
        assert entry.top_logprobs[0].logprob == entry.logprob
        assert entry.bytes == list(entry.token.encode())
        values = [alternative.logprob for alternative in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
    stream = client.chat.completions.create(
        messages=ASK, logprobs=True, top_logprobs=5, stream=True, **GREEDY
    )
    streamed = [e for chunk in stream for c in chunk.choices if c.logprobs
                for e in c.logprobs.content]  # fmt: skip
    assert [e.token for e in streamed] == [e.token for e in content]
    for later, first in zip(streamed, content, strict=True):  # its prompt now cached: 1e-4
        assert later.logprob == pytest.approx(first.logprob, abs=1e-4)
    plain = client.chat.completions.create(messages=ASK, **GREEDY)
    assert plain.choices[0].logprobs is None
    alone = client.chat.completions.create(messages=ASK, logprobs=True, **GREEDY)
    assert all(e.top_logprobs == [] for e in alone.choices[0].logprobs.content)


def test_completions_logprobs(client):
    reply = client.completions.create(model="tiny", prompt="Once upon", max_tokens=6,
                                      temperature=0, logprobs=3)  # fmt: skip
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == reply.usage.completion_tokens
    assert all(len(top) <= 3 and top for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs,
                                 strict=True):  # fmt: skip
        assert top[token] == value == max(top.values())


@pytest.mark.parametrize(
    ("kind", "fields", "param"),
    [
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": "yes"}, "logprobs"),
        ("text", {"logprobs": 6}, "logprobs"),
        ("text", {"top_logprobs": 2}, "top_logprobs"),  # chat's field: not the completions'
    ],
)
def test_out_of_range_is_400_naming_the_field(client, kind, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        if kind == "chat":
            client.chat.completions.create(messages=ASK, extra_body=fields, **GREEDY)
        else:
            client.completions.create(prompt="hi", extra_body=fields, **GREEDY)
    assert refused.value.body["param"] == param  # type: ignore[index]


def test_tgi_reports_each_tokens_logprob_and_its_top_tokens(door):
    tgi = text_generation.Client(door)
    reply = tgi.generate("Once upon", max_new_tokens=6, top_n_tokens=3)
    details = reply.details
    assert all(t.logprob is not None and t.logprob <= 0 for t in details.tokens)
    assert [len(top) for top in details.top_tokens] == [3] * len(details.tokens)
    for token, top in zip(details.tokens, details.top_tokens, strict=True):
        assert top[0].id == token.id and top[0].logprob == token.logprob  # greedy
    streamed = list(tgi.generate_stream("Once upon", max_new_tokens=6, top_n_tokens=3))
    assert [r.token.id for r in streamed] == [t.id for t in details.tokens]
    assert all(len(r.top_tokens) == 3 for r in streamed)
    plain = tgi.generate("Once upon", max_new_tokens=3)
    assert all(t.logprob is not None for t in plain.details.tokens)
