"""The coordinator as users run it: ``python -m coordinator --config ...`` processes, each with
its own local Ray and tiny model, in both deploy modes and over both transports; HTTPS on one."""

from __future__ import annotations

import concurrent.futures as futures
import json
import os
import shutil
import signal
import subprocess
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.support.coordinator_servers import MAX_ITER, infer
from tests.support.prerequisites import require

pytestmark = pytest.mark.ray


def _engine_answer(model_dir, text: str, max_new_tokens: int) -> tuple[str, int, str]:
    """The engine alone, greedy: text, number of tokens and finish reason."""
    engine = LLMEngine(
        EngineConfig(
            model_path=str(model_dir), device="cpu", cache=CacheConfig(block_size=4, num_blocks=64)
        )
    )
    engine.add_request(
        engine.request(
            "ref", engine.tokenizer.encode(text), SamplingParams(max_new_tokens=max_new_tokens)
        )
    )
    events = []
    while engine.has_work():
        events += engine.step()
    num_tokens = sum(e.token_id is not None for e in events)
    return "".join(e.text for e in events), num_tokens, events[-1].finish_reason.value


def test_probes_answer_200_once_ready(servers):
    for server in servers.values():
        for path in (
            "/v1/startup",
            "/v1/health",
            "/v1/readiness",
            "/v2/health/live",
            "/v2/health/ready",
        ):
            response = httpx.get(server.url("status_port", path))
            assert response.status_code == 200 and response.content == b""


def test_each_coordinator_runs_the_event_loop_its_config_names(servers):
    logs = {name: server.log_path.read_text() for name, server in servers.items()}
    assert "event loop: uvloop" in logs["grpc"]
    assert "event loop: asyncio" in logs["zmq"] and "event loop: asyncio" in logs["single"]


@pytest.mark.parametrize("name", ["zmq", "grpc"])
def test_same_greedy_answer_as_the_engine_alone(servers, tiny_model_dir, name):
    text = "The quick brown fox"
    response = infer(
        servers[name],
        {"inputs": text, "parameters": {"max_new_tokens": MAX_ITER, "details": True, "seed": 7}},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    expected_text, num_tokens, finish_reason = _engine_answer(tiny_model_dir, text, MAX_ITER)
    assert body["generated_text"] == expected_text
    details = body["details"]
    assert (details["generated_tokens"], details["finish_reason"]) == (num_tokens, finish_reason)
    assert details["seed"] == 7
    assert set(body) == {"generated_text", "details"}


def test_details_only_when_asked(servers):
    body = infer(servers["zmq"], {"inputs": "hello", "parameters": {"max_new_tokens": 3}}).json()
    assert set(body) == {"generated_text"}


def test_pd_accounting_reports_max_iter_times_plus_one(servers):
    parameters = {"max_new_tokens": 50, "details": True, "ignore_eos": True}
    pd = infer(servers["zmq"], {"inputs": "hello", "parameters": parameters}).json()
    assert pd["details"]["generated_tokens"] == MAX_ITER + 1  # prefill's token + maxIterTimes
    assert pd["details"]["finish_reason"] == "length"


def test_stream_format_byte_by_byte(servers):
    response = infer(
        servers["zmq"],
        {
            "inputs": "A paged KV cache",
            "stream": True,
            "parameters": {"max_new_tokens": 6, "details": True, "ignore_eos": True},
        },
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    raw = response.content
    assert raw.endswith(b"\n\n") and b"\r" not in raw
    chunks = raw[:-2].split(b"\n\n")
    events = []
    for chunk in chunks:
        assert chunk.startswith(b"data: ") and b"\n" not in chunk
        events.append(json.loads(chunk[6:]))
    last = events[-1]
    assert len(events) == last["details"]["generated_tokens"] == 6
    assert events[0]["prefill_time"] > 0 and events[0]["decode_time"] is None
    for event in events[1:]:
        assert event["prefill_time"] is None and event["decode_time"] >= 0
    for event in events[:-1]:
        assert set(event) == {"prefill_time", "decode_time", "token"}
        assert isinstance(event["token"]["id"], int) and isinstance(event["token"]["text"], str)
    assert last["token"]["text"] is None and isinstance(last["token"]["id"], int)
    assert last["generated_text"].startswith("".join(e["token"]["text"] for e in events[:-1]))


def test_full_text_enabled_streams_the_whole_text_so_far(servers):
    parameters = {"max_new_tokens": 5, "ignore_eos": True}
    response = infer(
        servers["single"], {"inputs": "hello", "stream": True, "parameters": parameters}
    )
    events = [json.loads(c[6:]) for c in response.content[:-2].split(b"\n\n")]
    assert len(events) == 5
    texts = [e["token"]["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert events[-1]["generated_text"].startswith(texts[-1]) and events[-1]["details"] is None


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        (
            {"inputs": "x", "parameters": {"top_p": 1.0}},
            422,
            "Parameter top_p must be a float in (1e-06, 1.0), but got 1.0",
        ),
        ({"inputs": "x", "parameters": {"priority": 6}}, 422, "Parameter priority must be"),
        ({"inputs": ""}, 422, "non-empty string"),
        (
            {"inputs": [{"type": "image_url", "image_url": "https://x/a.png"}]},
            422,
            "supports text input only",
        ),
        ({"inputs": "x" * 3000}, 422, "tokens after tokenization, but got"),
        ([1, 2], 400, "must be a JSON object"),
    ],
)
def test_errors_have_mindie_bodies(servers, body, status, fragment):
    response = infer(servers["zmq"], body)
    assert response.status_code == status
    payload = response.json()
    assert fragment in payload["error"]
    assert set(payload) == {"error", "error_type"}
    if status == 422:
        assert payload["error_type"] == "Input Validation Error"


def test_malformed_json_too_large_body_and_unknown_route(servers):
    server = servers["zmq"]
    with server.client() as client:
        bad = client.post(server.url("predict_port", "/infer"), content=b"{not json")
        big = client.post(
            server.url("predict_port", "/infer"),
            content=json.dumps({"inputs": "y" * (2 * 1024 * 1024)}).encode(),
        )
        missing = client.get(server.url("predict_port", "/nope"))
    assert bad.status_code == 400 and bad.json()["error_type"] == "Bad Request"
    assert big.status_code == 413
    assert missing.status_code == 404 and missing.json()["error_type"] == "NotFoundError"


def test_tokenizer_and_infer_token(servers):
    server = servers["zmq"]
    with server.client() as client:
        tokens = client.post(
            server.url("predict_port", "/v1/tokenizer"), json={"inputs": "hello world"}
        ).json()
        assert tokens["token_number"] == len(tokens["tokens"]) > 0
        by_ids = client.post(
            server.url("predict_port", "/infer_token"),
            json={"input_id": tokens["tokens"], "parameters": {"max_new_tokens": 4}},
        )
        by_text = client.post(
            server.url("predict_port", "/infer"),
            json={"inputs": "hello world", "parameters": {"max_new_tokens": 4}},
        )
    assert by_ids.status_code == 200 and by_ids.json() == by_text.json()


def test_metrics_have_mindie_names_and_pass_promtool(servers):
    text = httpx.get(servers["zmq"].url("external_port", "/metrics")).text
    for name in (
        "request_received_total",
        "request_success_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_requests_running",
        "num_requests_waiting",
        "npu_cache_usage_perc",
        "kv_cache_usage_perc",
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert name in text, name
    assert 'role="decode"' in text and 'role="prefill"' in text
    promtool = shutil.which("promtool")
    require(promtool, "promtool (Debian's prometheus; .ci/run installs it)")
    check = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr


def _instances(server) -> list[dict]:
    return httpx.get(server.url("manage_port", "/v1/instances")).json()["instances"]


def _idle(server) -> None:
    for _ in range(100):
        loads = _instances(server)
        if loads and all(x["num_free_blocks"] == x["num_total_blocks"] for x in loads):
            return
        time.sleep(0.1)
    raise AssertionError(f"blocks still in use: {loads}")


def _metric(server, name: str, **labels: str) -> float:
    """The sum of one family's samples on /metrics that carry ``labels``."""
    text = httpx.get(server.url("external_port", "/metrics")).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def _await_metric(server, name: str, value: float, **labels: str) -> None:
    """Polls until the coordinator's metric ``name`` (its samples carrying ``labels``) reads
    ``value``: the test orders events by what the coordinator has seen, never by sleeping."""
    for _ in range(1000):
        if _metric(server, name, **labels) == value:
            return
        time.sleep(0.01)
    raise AssertionError(f"{name} never reached {value}: {_metric(server, name, **labels)}")


def _assert_priority_runs_first_and_a_fourth_request_is_429(
    server, long: dict, short: dict
) -> None:
    """Behind the long blocker, a later priority-1 request overtakes an earlier priority 5, and a
    fourth request while three are in flight is refused with 429."""
    finished: list[str] = []

    def run(name, body):
        response = infer(server, body)
        finished.append(name)
        return response

    def short_with(priority: int) -> dict:
        return {**short, "parameters": {**short["parameters"], "priority": priority}}

    with futures.ThreadPoolExecutor(4) as pool:  # maxBatchSize 1: one runs, the rest queue
        first = pool.submit(run, "long-p5", long)
        _await_metric(server, "num_requests_running", 1)
        later_p5 = pool.submit(run, "later-p5", short_with(5))
        _await_metric(server, "num_requests_waiting", 1)
        p1 = pool.submit(run, "p1", short_with(1))
        _await_metric(server, "num_requests_waiting", 2)
        over = infer(server, short)  # a fourth request while three are in flight
        assert over.status_code == 429 and over.json()["error"] == "Too many requests"
        assert all(f.result().status_code == 200 for f in (first, later_p5, p1))
    assert finished == ["long-p5", "p1", "later-p5"]  # priority 1 overtakes an earlier 5


def _assert_a_stopped_engine_times_the_request_out(server, long: dict) -> None:
    """A request waiting on a stopped engine past its 1 s timeout answers 408, nothing left."""
    # The engine stopped (SIGSTOP) for longer than the request's 1 s, however fast the machine:
    # the request times out waiting, and the engine, once it goes on, has nothing left of it.
    (engine,) = _instances(server)
    os.kill(engine["pid"], signal.SIGSTOP)
    resume = threading.Timer(3.0, os.kill, (engine["pid"], signal.SIGCONT))
    resume.start()
    try:
        timed = {"inputs": "hi", "parameters": {**long["parameters"], "timeout": 1}}
        timed_out = infer(server, timed)
    finally:
        resume.join()
    assert timed_out.status_code == 408, timed_out.text
    assert timed_out.json()["error"] == "Request inference timeout"
    _idle(server)


def _assert_a_client_gone_mid_stream_is_counted_aborted(server, long: dict) -> None:
    """A client leaving a stream mid-way is counted once as aborted, and nothing is left held."""
    aborted_before = _metric(server, "request_failed_total", reason="aborted")
    with (
        server.client() as client,
        client.stream(
            "POST", server.url("predict_port", "/infer"), json={**long, "stream": True}
        ) as response,
    ):
        for index, _ in enumerate(response.iter_lines()):
            if index > 4:
                break  # the client goes away mid-stream
    # The coordinator counts the abort once the stream's generator closes, which may come a
    # moment after the engine has freed the request's blocks.
    _await_metric(server, "request_failed_total", aborted_before + 1, reason="aborted")
    _idle(server)


def test_https_priority_429_timeout_and_disconnect(servers):
    server = servers["single"]
    # ignore_eos and 500 tokens: the blocker holds the one batch slot (maxBatchSize 1) for
    # hundreds of decode steps while the test queues requests behind it.
    long = {
        "inputs": "hello",
        "parameters": {"max_new_tokens": 500, "priority": 5, "ignore_eos": True},
    }
    # 64 steps each: the order the answers reach the client is the order they ran in.
    short = {"inputs": "hello", "parameters": {"max_new_tokens": 64, "ignore_eos": True}}
    _assert_priority_runs_first_and_a_fourth_request_is_429(server, long, short)
    _assert_a_stopped_engine_times_the_request_out(server, long)
    _assert_a_client_gone_mid_stream_is_counted_aborted(server, long)
