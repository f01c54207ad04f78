"""The coordinator as users run it: ``python -m coordinator --config ...`` processes, each with
its own local Ray and tiny model, in both deploy modes and over both transports; HTTPS on one."""

from __future__ import annotations

import concurrent.futures as futures
import json
import shutil
import subprocess
import time

import httpx
import pytest

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.coordinator_servers import MAX_ITER, infer

pytestmark = pytest.mark.ray


def _engine_answer(model_dir, text: str, max_new_tokens: int) -> str:
    engine = LLMEngine(
        EngineConfig(
            model_path=str(model_dir), device="cpu", cache=CacheConfig(block_size=4, num_blocks=64)
        )
    )
    engine.add_request(
        "ref", engine.tokenizer.encode(text), SamplingParams(max_new_tokens=max_new_tokens)
    )
    pieces = []
    while engine.has_work():
        pieces += [e.text for e in engine.step()]
    return "".join(pieces)


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


@pytest.mark.parametrize("name", ["zmq", "grpc"])
def test_same_greedy_answer_as_the_engine_alone(servers, tiny_model_dir, name):
    text = "The quick brown fox"
    response = infer(
        servers[name],
        {"inputs": text, "parameters": {"max_new_tokens": MAX_ITER, "details": True, "seed": 7}},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["generated_text"] == _engine_answer(tiny_model_dir, text, MAX_ITER)
    assert body["details"]["seed"] == 7
    assert body["details"]["finish_reason"] in ("length", "eos_token")
    assert set(body) == {"generated_text", "details"}


def test_details_only_when_asked(servers):
    body = infer(servers["zmq"], {"inputs": "hello", "parameters": {"max_new_tokens": 3}}).json()
    assert set(body) == {"generated_text"}


def test_pd_accounting_reports_max_iter_times_plus_one(servers):
    pd = infer(
        servers["zmq"], {"inputs": "hello", "parameters": {"max_new_tokens": 50, "details": True}}
    ).json()
    assert pd["details"]["generated_tokens"] in (MAX_ITER + 1, *range(1, MAX_ITER + 1))
    if pd["details"]["finish_reason"] == "length":
        assert pd["details"]["generated_tokens"] == MAX_ITER + 1


def test_stream_format_byte_by_byte(servers):
    response = infer(
        servers["zmq"],
        {
            "inputs": "A paged KV cache",
            "stream": True,
            "parameters": {"max_new_tokens": 6, "details": True},
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
    assert len(events) == last["details"]["generated_tokens"]
    assert events[0]["prefill_time"] > 0 and events[0]["decode_time"] is None
    for event in events[1:]:
        assert event["prefill_time"] is None and event["decode_time"] >= 0
    for event in events[:-1]:
        assert set(event) == {"prefill_time", "decode_time", "token"}
        assert isinstance(event["token"]["id"], int) and isinstance(event["token"]["text"], str)
    assert last["token"]["text"] is None and isinstance(last["token"]["id"], int)
    assert last["generated_text"].startswith("".join(e["token"]["text"] for e in events[:-1]))


def test_full_text_enabled_streams_the_whole_text_so_far(servers):
    response = infer(
        servers["single"], {"inputs": "hello", "stream": True, "parameters": {"max_new_tokens": 5}}
    )
    events = [json.loads(c[6:]) for c in response.content[:-2].split(b"\n\n")]
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
    if promtool is None:
        pytest.skip("promtool not installed (.ci/run installs Debian's prometheus)")
    check = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr


def _idle(server) -> None:
    for _ in range(100):
        loads = httpx.get(server.url("manage_port", "/v1/instances")).json()["instances"]
        if loads and all(x["num_free_blocks"] == x["num_total_blocks"] for x in loads):
            return
        time.sleep(0.1)
    raise AssertionError(f"blocks still in use: {loads}")


def test_https_priority_429_timeout_and_disconnect(servers):
    server = servers["single"]
    long = {"inputs": "hello", "parameters": {"max_new_tokens": 400, "priority": 5}}
    short = {"inputs": "hello", "parameters": {"max_new_tokens": 3}}
    finished: list[str] = []

    def run(name, body):
        response = infer(server, body)
        finished.append(name)
        return response

    with futures.ThreadPoolExecutor(4) as pool:  # maxBatchSize 1: one runs, the rest queue
        first = pool.submit(run, "long-p5", long)
        time.sleep(0.5)
        later_p5 = pool.submit(
            run, "later-p5", {**short, "parameters": {**short["parameters"], "priority": 5}}
        )
        time.sleep(0.2)
        p1 = pool.submit(run, "p1", {**short, "parameters": {**short["parameters"], "priority": 1}})
        time.sleep(0.2)
        over = infer(server, short)  # a fourth request while three are in flight
        assert over.status_code == 429 and over.json()["error"] == "Too many requests"
        assert all(f.result().status_code == 200 for f in (first, later_p5, p1))
    assert finished.index("p1") < finished.index("later-p5")

    with futures.ThreadPoolExecutor(2) as pool:
        blocker = pool.submit(infer, server, long)
        time.sleep(0.3)
        timed_out = infer(server, {"inputs": "hi", "parameters": {"timeout": 1}})
        assert timed_out.status_code == 408
        assert timed_out.json()["error"] == "Request inference timeout"
        assert blocker.result().status_code == 200
    _idle(server)

    with (
        server.client() as client,
        client.stream(
            "POST", server.url("predict_port", "/infer"), json={**long, "stream": True}
        ) as response,
    ):
        for index, _ in enumerate(response.iter_lines()):
            if index > 4:
                break  # the client goes away mid-stream
    _idle(server)
