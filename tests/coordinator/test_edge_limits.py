"""The edges of the predict app a client controls: every list and size has a limit answered 422
(naming the parameter, the limit and the value) in the door's own shape; embeddings are admitted
like generations; the content filter guards every generation route; an unexpected failure tells
the client only an id; a huge chunked body costs the server no memory. The app runs in process
over a scripted service (no Ray)."""

from __future__ import annotations

import json
import logging
import os

import httpx
import psutil
import pytest

from coordinator.api.limits import (
    MAX_EMBEDDING_INPUTS,
    MAX_INVOCATION_ROWS,
    MAX_MESSAGES,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    default_body_limit_mb,
    prompt_char_limit,
)
from coordinator.api.mindie_request import MAX_INPUT_ITEMS
from tests.support.door_fakes import AZURE_CHAT, MESSAGES, serving
from tests.support.edge_apps import (
    AZURE_EMBED,
    CHAR_CAP,
    FILTER,
    LONG_PROMPTS,
    LONG_STOP,
    MANY_STOPS,
    MAX_INPUT_TOKENS,
    STOP_ROUTES,
    AdmittingService,
    BrokenService,
    CountingTokenizer,
    FailingEventsService,
    app_for,
    message_of,
    post,
)


@pytest.mark.parametrize(("path", "body"), STOP_ROUTES, ids=[r[0] for r in STOP_ROUTES])
def test_ten_thousand_stop_strings_are_422_naming_the_limit(path, body):
    response = post(app_for(), path, body(MANY_STOPS))
    assert response.status_code == 422, response.text
    expected = f"stop may hold at most {MAX_STOP_SEQUENCES} stop sequences, but got 10000"
    assert message_of(response) == expected


@pytest.mark.parametrize(("path", "body"), STOP_ROUTES, ids=[r[0] for r in STOP_ROUTES])
def test_a_stop_string_over_the_length_limit_is_422(path, body):
    response = post(app_for(), path, body(LONG_STOP))
    assert response.status_code == 422, response.text
    expected = f"stop[0] may hold at most {MAX_STOP_CHARS} characters, but got {MAX_STOP_CHARS + 1}"
    assert message_of(response) == expected


def test_stop_within_the_limits_still_generates():
    response = post(app_for(), "/v1/completions", {"prompt": "hi", "stop": ["x"] * 4})
    assert response.status_code == 200, response.text


def test_ten_thousand_invocations_rows_are_422():
    body = {"dataframe_records": [{"messages": MESSAGES}] * 10_000}
    response = post(app_for(), "/invocations", body)
    assert response.status_code == 422
    assert response.json() == {
        "error_code": "INVALID_PARAMETER_VALUE",
        "message": f"the input may hold at most {MAX_INVOCATION_ROWS} rows, but got 10000",
    }


def test_invocations_rows_never_exceed_max_requests():
    body = {"dataframe_records": [{"messages": MESSAGES}] * 3}
    response = post(app_for(AdmittingService(max_requests=2)), "/invocations", body)
    assert response.status_code == 422
    assert response.json()["message"] == "the input may hold at most 2 rows, but got 3"
    two = {"dataframe_records": [{"messages": MESSAGES}] * 2}
    assert post(app_for(AdmittingService(max_requests=2)), "/invocations", two).status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", AZURE_CHAT, "/invocations"])
def test_too_many_chat_messages_are_422(path):
    messages = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    response = post(app_for(), path, {"messages": messages})
    assert response.status_code == 422, response.text
    expected = f"messages may hold at most {MAX_MESSAGES} messages, but got {MAX_MESSAGES + 1}"
    assert message_of(response) == expected


def test_tokenizer_input_has_the_token_limit_of_infer():
    app = app_for()
    ok = post(app, "/v1/tokenizer", {"inputs": "x" * MAX_INPUT_TOKENS})
    assert ok.status_code == 200 and ok.json()["token_number"] == MAX_INPUT_TOKENS
    over = post(app, "/v1/tokenizer", {"inputs": "x" * (MAX_INPUT_TOKENS + 1)})
    assert over.status_code == 422
    assert over.json() == {
        "error": f"Parameter inputs must be [1, {MAX_INPUT_TOKENS}] tokens after tokenization, "
        f"but got {MAX_INPUT_TOKENS + 1} tokens",
        "error_type": "Input Validation Error",
    }


@pytest.mark.parametrize("path", ["/v1/embeddings", AZURE_EMBED])
def test_too_many_embedding_inputs_are_422(path):
    response = post(app_for(), path, {"input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)})
    assert response.status_code == 422
    expected = f"input may hold at most {MAX_EMBEDDING_INPUTS} texts, but got 2049"
    assert message_of(response) == expected


@pytest.mark.parametrize(
    ("path", "busy", "draining"),
    [
        (
            "/v1/embeddings",
            {"message": "the server is busy; retry later", "type": "server_error"},
            {"type": "server_error"},
        ),
        (AZURE_EMBED, {"code": "TooManyRequests"}, {"code": "NoWorkerError"}),
    ],
)
def test_embeddings_are_admitted_like_generations(path, busy, draining):
    service = AdmittingService(max_requests=1)
    app = app_for(service)
    assert post(app, path, {"input": "x"}).status_code == 200
    assert service.in_flight == 0  # counted while it ran, released after
    service.in_flight = 1
    full = post(app, path, {"input": "x"})
    assert full.status_code == 429
    assert busy.items() <= full.json()["error"].items()
    assert full.headers["retry-after"] == "1"
    service.in_flight, service.draining = 0, True
    drained = post(app, path, {"input": "x"})
    assert drained.status_code == 503
    assert "shutting down" in message_of(drained)
    assert drained.headers["retry-after"] == "5"
    assert draining.items() <= drained.json()["error"].items()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/infer", {"inputs": "a forbidden word"}),
        ("/infer", {"inputs": [{"type": "text", "text": "a forbidden word"}], "stream": True}),
        ("/infer_token", {"input_id": [ord(c) for c in "so forbidden"]}),
        ("/generate", {"inputs": "a forbidden word"}),
        ("/generate_stream", {"inputs": "a forbidden word"}),
        ("/", {"inputs": "a forbidden word", "stream": True}),
    ],
)
def test_mindie_and_tgi_refuse_a_blocked_input(path, body):
    response = post(app_for(content_filter=FILTER), path, body)
    assert response.status_code == 400
    assert response.json() == {
        "error": "The input was filtered by the content safety policy",
        "error_type": "content_filter",
    }


@pytest.mark.parametrize("path", ["/infer", "/generate"])
def test_an_allowed_input_still_generates(path):
    response = post(app_for(content_filter=FILTER), path, {"inputs": "a fine word"})
    assert response.status_code == 200, response.text


def test_an_unexpected_failure_is_a_generic_500_with_a_logged_id(caplog):
    with caplog.at_level(logging.ERROR, logger="coordinator.api.app"):
        response = post(app_for(BrokenService()), "/infer", {"inputs": "hi"})
    assert response.status_code == 500
    error_id = response.headers["x-request-id"]
    assert response.json() == {
        "error": f"Internal error; request id {error_id}",
        "error_type": "Incomplete Generation",
    }
    assert "Traceback" not in response.text and "RuntimeError" not in response.text
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and logged[0].exc_info and "RayTaskError" in str(logged[0].exc_info[1])


def test_a_failure_inside_the_service_names_only_an_id():
    response = post(app_for(FailingEventsService()), "/infer", {"inputs": "hi"})
    assert response.status_code == 500
    message = response.json()["error"]
    assert message.startswith("Incomplete Generation: Internal error; request id ")
    assert "worker internals" not in message and "KeyError" not in message


@pytest.mark.parametrize("path", ["/tmp/a\x00b.png", "/tmp/\udcff.png", "\x00" * 80])
def test_a_media_path_the_file_system_cannot_take_is_422(path):
    body = {"inputs": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": path}]}
    raw = json.dumps(body).encode()  # lone surrogates survive as \\udcff escapes
    response = post(app_for(), "/infer", None, content=raw)
    assert response.status_code == 422, response.text
    assert response.json()["error_type"] == "Input Validation Error"


def test_a_chunked_100_mb_body_is_413_without_buffering():
    process = psutil.Process(os.getpid())  # the uvicorn server runs in this process
    chunk = b"x" * (1024 * 1024)

    def body():
        yield b'{"inputs": "'
        for _ in range(100):
            yield chunk

    with serving(app_for(body_limit_mb=1)) as url:
        before = process.memory_info().rss
        response = httpx.post(f"{url}/infer", content=body(), timeout=60)
        grown = process.memory_info().rss - before
    assert response.status_code == 413
    assert response.json()["error_type"] == "Payload Too Large"
    assert grown < 8 * 1024 * 1024, f"RSS grew by {grown} bytes"


@pytest.mark.parametrize(("path", "body", "name"), LONG_PROMPTS)
def test_a_prompt_over_the_character_cap_is_422_before_it_is_tokenized(path, body, name):
    app = app_for(tokenizer=CountingTokenizer())
    CountingTokenizer.calls = 0
    response = post(app, path, body)
    assert response.status_code == 422, response.text
    assert f"at most {CHAR_CAP}" in message_of(response), message_of(response)
    assert name in message_of(response)
    assert CountingTokenizer.calls == 0


def test_a_prompt_at_the_character_cap_goes_on_to_the_token_limit():
    response = post(app_for(), "/v1/completions", {"prompt": "x" * CHAR_CAP})
    assert response.status_code == 400
    assert "tokens" in message_of(response)


def test_list_form_inputs_hold_a_bounded_number_of_items():
    items = [{"type": "text", "text": "a"}] * (MAX_INPUT_ITEMS + 1)
    response = post(app_for(), "/infer", {"inputs": items})
    assert response.status_code == 422
    expected = f"Parameter inputs may hold at most {MAX_INPUT_ITEMS} items, but got {len(items)}"
    assert message_of(response) == expected


def test_the_default_body_limit_fits_the_largest_legal_prompt_however_escaped():
    prompt = "\x01" * prompt_char_limit(2048)  # each one \\u0001 in JSON: 6 bytes
    body = json.dumps({"inputs": prompt, "parameters": {"max_new_tokens": 1}}).encode()
    assert len(body) <= default_body_limit_mb(2048) * 1024 * 1024
    assert default_body_limit_mb(2048) == 2


def test_body_limit_0_is_what_the_served_prompt_limit_needs():
    app = app_for(body_limit_mb=0)  # the model takes 100 tokens: 1600 characters, 1 MB + 1
    assert default_body_limit_mb(MAX_INPUT_TOKENS) == 2
    under = post(app, "/infer", None, content=b" " * (2 * 1024 * 1024 - 10) + b"{}")
    over = post(app, "/infer", None, content=b" " * (2 * 1024 * 1024 + 1))
    assert under.status_code == 422, under.text  # read whole: the inputs are missing
    assert over.status_code == 413
