"""Property-based fuzz of the predict app's HTTP surface: no request, however malformed, gets a
5xx answer or hangs.

Every JSON ``POST`` route the app serves is fuzzed; the routes are read from the app's OpenAPI
document, so a route added later is fuzzed without a change here. Each route gets three kinds of
body: arbitrary JSON values, objects shaped like the doors' requests (a valid body of some door
with fields overlaid by values of any type: parameter objects, message lists with random roles
and content, MLflow envelopes, edge numbers, lone surrogates), and raw bytes that are mostly not
JSON (binary, truncated, too deep, numbers of too many digits). Each request also carries random
headers (``Content-Type`` present or not, right or wrong; a true or false ``Content-Length``;
``Accept``, ``Authorization``, ``api-key``, ``extra-parameters``, arbitrary others) and a random
query string (``api-version``, arbitrary others). Bodies are serialized by Python's ``json``,
``NaN`` and ``Infinity`` included: the server's parser accepts them, so a client can send them.

Every answer must come within :data:`REQUEST_TIMEOUT_S` (a streamed answer is read whole), with a
status below 500, and an error answer must be a JSON body. The app runs in process over a
scripted service (no cluster), with the embedding routes and the content filter on; it has no
startup or shutdown work, so the ASGI transport's skipping of the lifespan changes nothing.

Examples are random (not derandomized): every run explores new inputs, and a failure prints the
falsifying example to reproduce it; the bugs the fuzz has found are pinned as plain regression
tests at the end. Each route gets :data:`EXAMPLES` examples of each kind (default 12: about 600
requests in all; ``PDSERVE_FUZZ_EXAMPLES`` scales it up for a local hunt, e.g. 200 in about a
minute). At the default the file runs in about 10 s.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.api.azure import API_VERSIONS
from tests.support.door_fakes import MESSAGES
from tests.support.edge_apps import FILTER, app_for

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "12"))
REQUEST_TIMEOUT_S = 10
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # nothing written to the working tree; a failure prints its example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---- the app and its routes ------------------------------------------------------------------

APP = app_for(content_filter=FILTER)
KNOWN_ROUTES = {
    "/infer",
    "/infer_token",
    "/v1/tokenizer",
    "/v1/completions",
    "/v1/chat/completions",
    "/chat/completions",
    "/models/chat/completions",
    "/images/embeddings",
    "/models/images/embeddings",
    "/generate",
    "/generate_stream",
    "/",
    "/v1/embeddings",
    "/embeddings",
    "/models/embeddings",
    "/invocations",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/openai/v1/chat/completions",
    "/openai/v1/completions",
    "/v1/responses",
}


def json_post_routes(app: FastAPI) -> list[str]:
    """The paths the app answers ``POST`` on, from its OpenAPI document."""
    return sorted(path for path, methods in app.openapi()["paths"].items() if "post" in methods)


def request_fields(app: FastAPI, path: str) -> list[str]:
    """The property names of the route's JSON request schema, where it declares one."""
    spec = app.openapi()
    body = spec["paths"][path]["post"].get("requestBody", {})
    schema = body.get("content", {}).get("application/json", {}).get("schema", {})
    if "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return sorted(schema.get("properties", {}))


ROUTES = json_post_routes(APP)

# ---- valid bodies, the starting points of shaped bodies --------------------------------------

CHAT = {"messages": MESSAGES}
MLFLOW_BODIES = [
    CHAT,
    {"dataframe_records": [CHAT]},
    {"dataframe_split": {"columns": ["messages"], "data": [[MESSAGES]]}},
    {"instances": [CHAT]},
    {"inputs": CHAT},
    {"inputs": CHAT, "params": {"temperature": 0.5, "max_tokens": 3}},
]
VALID_BODIES: dict[str, list[dict[str, Any]]] = {
    "/infer": [{"inputs": "hi", "stream": False, "parameters": {"seed": 7}}],
    "/infer_token": [{"input_id": [104, 105]}],
    "/v1/tokenizer": [{"inputs": "hi"}],
    "/v1/completions": [{"prompt": "hi"}],
    "/v1/chat/completions": [CHAT],
    "/chat/completions": [CHAT],
    "/models/chat/completions": [CHAT],
    "/generate": [{"inputs": "hi", "parameters": {"seed": 7}}],
    "/generate_stream": [{"inputs": "hi", "parameters": {"seed": 7}}],
    "/": [{"inputs": "hi", "stream": True}],
    "/v1/embeddings": [{"input": ["a", "b"]}],
    "/embeddings": [{"input": "hi"}],
    "/models/embeddings": [{"input": "hi"}],
    "/invocations": MLFLOW_BODIES,
    "/v1/messages": [
        {"model": "m", "max_tokens": 3, "messages": MESSAGES},
        {"model": "m", "max_tokens": 3, "messages": MESSAGES, "stream": True, "system": "s"},
    ],
    "/v1/messages/count_tokens": [{"model": "m", "messages": MESSAGES}],
    "/openai/v1/chat/completions": [CHAT],
    "/openai/v1/completions": [{"prompt": "hi"}],
    "/v1/responses": [
        {"model": "m", "input": "hi", "max_output_tokens": 3},
        {
            "model": "m",
            "input": [{"role": "user", "content": "hi"}],
            "stream": True,
            "instructions": "s",
            "store": False,
        },
    ],
}
ALL_VALID_BODIES = [body for bodies in VALID_BODIES.values() for body in bodies]

# ---- JSON values ---------------------------------------------------------------------------

EDGE_NUMBERS = [
    *(0, 1, -1, 2, 5, 7, 1000, 2**31 - 1, 2**31, 2**63, 2**64 - 1, 2**64, -(2**64), 10**300),
    *(1e-7, 1e-6, 0.5, 1.0, 2.0, 100.0, -0.0, 1e308, math.nan, math.inf, -math.inf),
]
EDGE_TEXTS = [
    *("", " ", "hi", "forbidden", "\x00", "\ud800", "a\udfffb", "\U0001f600", "x" * 300),
    *("user", "system", "assistant", "tool", "text", "image_url", "video_url", "audio_url"),
    *("http://h/a.png", "data:image/png;base64,AAAA", "data:,", "/etc/passwd", "a/../b.png"),
    *("float", "base64", "auto", "none", "error", "drop", "pass-through", "messages"),
]
PARAMETER_NAMES = [
    *("temperature", "top_k", "top_p", "max_new_tokens", "max_tokens", "max_completion_tokens"),
    *("do_sample", "seed", "repetition_penalty", "typical_p", "details", "watermark"),
    *("ignore_eos", "priority", "timeout", "stop", "n", "stream", "min_tokens"),
    *("presence_penalty", "frequency_penalty", "encoding_format", "dimensions", "input_type"),
]
FIELD_NAMES = [
    *("inputs", "input_id", "prompt", "messages", "parameters", "params", "model", "input"),
    *("dataframe_split", "dataframe_records", "instances", "role", "content"),
    *("tools", "tool_choice", "response_format", "stream_options"),
    *PARAMETER_NAMES,
]

numbers = st.one_of(
    st.sampled_from(EDGE_NUMBERS),
    st.integers(),
    st.integers(min_value=-(10**4000), max_value=10**4000),  # past int64, within the digit limit
    st.floats(),
)
texts = st.one_of(
    st.sampled_from(EDGE_TEXTS), st.text(st.characters(exclude_categories=()), max_size=12)
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=12,
)


def keyed(names: list[str], values: st.SearchStrategy[Any]) -> st.SearchStrategy[dict]:
    """Objects with some of ``names`` (and now and then another key), of ``values``."""
    keys = st.one_of(st.sampled_from(names), st.sampled_from(names), texts)
    return st.dictionaries(keys, values, max_size=5)


CONTENT_KINDS = ["text", "image_url", "video_url", "audio_url"]
content_items = st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(CONTENT_KINDS), scalars)},
    optional={kind: st.one_of(scalars, json_values) for kind in CONTENT_KINDS},
)
contents = st.one_of(texts, st.lists(content_items, max_size=3), json_values)
messages_lists = st.lists(
    st.one_of(
        st.fixed_dictionaries({"role": texts, "content": contents}),
        keyed(["role", "content", "name"], st.one_of(texts, contents)),
    ),
    max_size=4,
)
parameter_objects = keyed(PARAMETER_NAMES, st.one_of(numbers, texts, st.lists(texts, max_size=5)))
column_names = st.one_of(st.sampled_from(["messages", "prompt", "temperature", "seed"]), scalars)
dataframe_splits = st.fixed_dictionaries(
    {},
    optional={
        "columns": st.one_of(st.lists(st.one_of(column_names, json_values), max_size=3), scalars),
        "data": st.one_of(
            st.lists(st.lists(st.one_of(messages_lists, scalars), max_size=3), max_size=3),
            json_values,
        ),
        "index": json_values,
    },
)
field_values = st.one_of(
    scalars,
    json_values,
    messages_lists,
    st.lists(messages_lists, max_size=2),
    parameter_objects,
    dataframe_splits,
    st.lists(st.one_of(parameter_objects, st.fixed_dictionaries({"messages": messages_lists}))),
)


def overlaid(base: dict[str, Any], fields: dict[str, Any], dropped: set[str]) -> dict[str, Any]:
    return {k: v for k, v in {**base, **fields}.items() if k not in dropped}


def shaped_bodies(path: str) -> st.SearchStrategy[dict[str, Any]]:
    """A valid body (the route's own, more often than another route's) with fields overlaid by
    values of any type, and some of its fields dropped."""
    own = VALID_BODIES.get(path, ALL_VALID_BODIES)
    names = [*FIELD_NAMES, *request_fields(APP, path)]
    return st.builds(
        overlaid,
        st.one_of(st.sampled_from(own), st.sampled_from(own), st.sampled_from(ALL_VALID_BODIES)),
        keyed(names, field_values),
        st.sets(st.sampled_from(names), max_size=2),
    )


def encoded(value: Any) -> bytes:
    """``value`` as JSON text; ``NaN``/``Infinity`` included, lone surrogates escaped."""
    return json.dumps(value).encode()


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


RAW_BODIES = [
    *(b"", b" ", b"{", b'{"inputs": ', b"null", b"NaN", b"-Infinity", b"\xff\xfe\x00", b"\x00"),
    *(b"1" * 5000, b'{"inputs": "hi", "seed": ' + b"9" * 4400 + b"}", b"\xef\xbb\xbf{}"),
    *(nested(900), nested(1100), nested(100_000), b'{"a":' * 2000 + b"1" + b"}" * 2000),
    *(b'{"inputs": "\\ud800"}', b'{"prompt": "\\udfff"}', b'{"\\ud800": 1}'),
    *(b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', b'{"input": ["\\udc00"]}'),
    '{"inputs": "hi"}'.encode("utf-16"),
    '{"inputs": "hé"}'.encode("latin-1"),
]
raw_bodies = st.one_of(st.sampled_from(RAW_BODIES), st.binary(max_size=64))

# ---- headers and query strings -------------------------------------------------------------

printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=24)
header_names = st.text(
    st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789-"), min_size=1, max_size=12
).filter(lambda name: name not in ("content-length", "host", "transfer-encoding"))


def mostly(usual: st.SearchStrategy[Any], *others: st.SearchStrategy[Any]) -> st.SearchStrategy:
    """``usual`` about three times in four, else one of ``others``: most requests get past the
    header checks to the body's."""
    return st.sampled_from([True, True, True, False]).flatmap(
        lambda is_usual: usual if is_usual else st.one_of(*others)
    )


CONTENT_TYPES = [
    "application/json; charset=utf-8",
    "APPLICATION/JSON;charset=latin-1",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "",
]
header_values = {
    "content-type": mostly(st.just("application/json"), st.sampled_from(CONTENT_TYPES), printable),
    "accept": st.one_of(
        st.sampled_from(["*/*", "application/json", "text/event-stream"]), printable, st.none()
    ),
    "authorization": st.one_of(st.just("Bearer key"), printable, st.none()),
    "api-key": st.one_of(printable, st.none()),
    "extra-parameters": mostly(st.sampled_from(["drop", "pass-through", "error", None]), printable),
}
CONTENT_LENGTHS = ["0", "1", "-1", "abc", "1.5", "99999999999", "+5", " 7"]
content_lengths = mostly(st.just("true"), st.sampled_from(CONTENT_LENGTHS))
query_strings = st.builds(
    lambda version, others: {**others, **({"api-version": version} if version else {})},
    mostly(st.sampled_from(API_VERSIONS), printable, st.none()),
    st.dictionaries(printable, printable, max_size=2),
)


@dataclass
class Headers:
    """The headers of one request, and what its ``Content-Length`` says."""

    named: dict[str, str]
    content_length: str  # "true": the body's own length, as httpx sets it

    def for_body(self, body: bytes) -> dict[str, str]:
        if self.content_length == "true":
            return self.named
        return {**self.named, "content-length": self.content_length}


def headers_of(named: dict[str, str | None], extra: dict[str, str], length: str) -> Headers:
    present = {k: v for k, v in named.items() if v is not None}
    return Headers({**extra, **present}, length)


headers = st.builds(
    headers_of,
    st.fixed_dictionaries(header_values),
    st.dictionaries(header_names, printable, max_size=3),
    content_lengths,
)

# ---- sending a request and judging its answer -----------------------------------------------


async def exchange(
    app: FastAPI, path: str, body: bytes, head: Headers, query: dict[str, str]
) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://door") as client:
        request = client.post(path, content=body, headers=head.for_body(body), params=query)
        return await asyncio.wait_for(request, REQUEST_TIMEOUT_S)


def send(path: str, body: bytes, head: Headers, query: dict[str, str]) -> httpx.Response:
    try:
        return asyncio.run(exchange(APP, path, body, head, query))
    except TimeoutError:
        pytest.fail(f"POST {path} hung for {REQUEST_TIMEOUT_S} s: body {body[:300]!r}")


def assert_answered_well(response: httpx.Response, body: bytes) -> None:
    """Below 500; an error answer is a JSON body."""
    request = f"POST {response.request.url} with body {body[:300]!r}"
    status = response.status_code
    assert status < 500, f"{request} answered {status}: {response.text[:500]}"
    if status >= 400:
        assert response.headers.get("content-type") == "application/json", request
        assert response.json(), f"{request} answered {status} with an empty error"
    else:
        assert response.content, f"{request} answered {status} with no body"


def fuzz(path: str, body: bytes, head: Headers, query: dict[str, str]) -> None:
    assert_answered_well(send(path, body, head, query), body)


# ---- the fuzz ------------------------------------------------------------------------------


def test_routes_are_enumerated_from_the_app():
    assert ROUTES, "the app serves no POST route"
    assert set(ROUTES) >= KNOWN_ROUTES
    assert not APP.router.on_startup and not APP.router.on_shutdown  # no lifespan work to run


@pytest.mark.parametrize("path", sorted(VALID_BODIES))
def test_each_valid_body_is_answered_200(path):
    """The fuzz starts from these bodies: each must be answered (and streamed) whole."""
    query = {"api-version": API_VERSIONS[0]}
    head = Headers({"content-type": "application/json"}, "true")
    for body in VALID_BODIES[path]:
        response = send(path, encoded(body), head, query)
        assert response.status_code == 200, (body, response.text)


@pytest.mark.parametrize("path", ROUTES)
@FUZZ
@given(value=json_values, head=headers, query=query_strings)
def test_any_json_value_is_never_a_server_error(path, value, head, query):
    fuzz(path, encoded(value), head, query)


@pytest.mark.parametrize("path", ROUTES)
@FUZZ
@given(data=st.data(), head=headers, query=query_strings)
def test_shaped_bodies_are_never_a_server_error(path, data, head, query):
    fuzz(path, encoded(data.draw(shaped_bodies(path), label="body")), head, query)


@pytest.mark.parametrize("path", ROUTES)
@FUZZ
@given(body=raw_bodies, head=headers, query=query_strings)
def test_raw_bytes_are_never_a_server_error(path, body, head, query):
    fuzz(path, body, head, query)


# ---- regressions: requests that were answered 500 ------------------------------------------

TEXT_PART_NOT_A_STRING = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
FOUND_BUGS = [  # (path, body, status, a part of the error message)
    ("/v1/completions", b"1" * 5000, 400, "4300 digits"),
    ("/infer", nested(100_000), 400, "nested too deeply"),
    ("/infer", b'{"inputs": "\\ud800"}', 422, "lone surrogate"),
    ("/v1/embeddings", b'{"input": ["a\\udfffb"]}', 422, "lone surrogate"),
    ("/infer", b'{"inputs": "\xed\xa0\x80"}', 400, "malformed JSON"),  # a UTF-8-encoded surrogate
    ("/generate", encoded({"inputs": "hi", "parameters": True}), 422, "parameters must be"),
    ("/", encoded({"inputs": "hi", "parameters": [1]}), 422, "parameters must be"),
    ("/chat/completions", encoded({**CHAT, "presence_penalty": math.nan}), 400, "got NaN"),
    ("/embeddings", encoded({"input": "x", "encoding_format": -math.inf}), 422, "-Infinity"),
    ("/v1/chat/completions", encoded(TEXT_PART_NOT_A_STRING), 400, "content[0].text"),
    ("/invocations", encoded(TEXT_PART_NOT_A_STRING), 400, "content[0].text"),
    ("/invocations", encoded({"dataframe_split": {"columns": 5, "data": [[1]]}}), 400, "columns"),
    (
        "/invocations",
        encoded({"dataframe_split": {"columns": [[1]], "data": [[MESSAGES]]}}),
        400,
        "columns",
    ),
    (
        "/invocations",
        encoded({"dataframe_split": {"columns": ["messages", 1, "x"], "data": [[MESSAGES, 2, 3]]}}),
        400,
        "columns",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "message"), FOUND_BUGS, ids=[f"{p}-{m}" for p, _, _, m in FOUND_BUGS]
)
def test_found_bugs_are_client_errors(path, body, status, message):
    head = Headers({"content-type": "application/json"}, "true")
    response = send(path, body, head, {"api-version": API_VERSIONS[0]})
    assert response.status_code == status, response.text
    assert message in response.text
