"""Prefix caching as clients and operators see it: the cached prompt tokens in OpenAI's and
Azure's ``usage`` and in ``/infer``'s ``details`` (the figure of the latest event with a token),
the prefix cache counters and cached-blocks gauge on ``/metrics`` (counters that never go
backwards, a worker restart included), and the dashboard's hit-rate panel, evaluated by
``promtool`` on synthetic series."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from azure.ai.inference import ChatCompletionsClient
from azure.ai.inference.models import UserMessage
from azure.core.credentials import AzureKeyCredential
from prometheus_client.parser import text_string_to_metric_families

from coordinator.api.mindie_format import InferAnswer
from coordinator.api.openai_format import Completion
from coordinator.metrics import Metrics
from engine.outputs import EngineStats, TokenEvent
from engine.request import FinishReason
from tests.support.door_fakes import AZURE_CHAT, MESSAGES, events, post, predict_app, serving
from tests.support.metrics_names import DASHBOARD, metric_names
from tests.support.prerequisites import require
from workers.contracts import WorkerLoad

PROMPT_TOKENS = 2  # "hi": the fake tokenizer makes one token per character


class CachingService:
    """One token event per entry of ``cached``, each reporting that many cached prompt tokens (a
    change between events stands for a migration to another pair); the last finishes by
    length, or, with ``tokenless_end``, a last event without a token (and no cached figure)
    follows."""

    def __init__(self, cached: list[int], tokenless_end: bool = False) -> None:
        self.cached, self.tokenless_end = cached, tokenless_end
        self.in_flight, self.max_requests, self.draining = 0, 100, False  # admission

    def count_refusal(self) -> None:
        """Admission's hook for a request refused at the door (nothing counts it here)."""

    def new_request_id(self) -> str:
        return "req-1"

    async def generate(self, request: Any):
        n, last = request.num_prompt_tokens, len(self.cached) - 1
        for i, cached in enumerate(self.cached):
            finish = FinishReason.LENGTH if i == last and not self.tokenless_end else None
            yield _event(request.request_id, 10 + i, n, i + 1, finish, cached)
        if self.tokenless_end:
            yield _event(request.request_id, None, n, len(self.cached), FinishReason.STOP, 0)


def _event(
    request_id: str,
    token_id: int | None,
    num_prompt: int,
    num_output: int,
    finish: FinishReason | None,
    cached: int,
) -> TokenEvent:
    text = "" if token_id is None else "ab"[num_output % 2]
    return TokenEvent(
        request_id,
        token_id,
        text,
        num_prompt,
        num_output,
        time.monotonic(),
        finish,
        num_cached_tokens=cached,
    )


def _sent(response: httpx.Response) -> list[dict]:
    """The JSON payloads of a stream's events (OpenAI's ``[DONE]`` left out)."""
    data = [e.removeprefix(b"data:").strip() for e in events(response)]
    return [json.loads(d) for d in data if d != b"[DONE]"]


def _usage(cached: int, completion_tokens: int = 3) -> dict[str, Any]:
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": completion_tokens,
        "total_tokens": PROMPT_TOKENS + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


OPENAI_STYLE = [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
    (AZURE_CHAT, {"messages": MESSAGES}),
    ("/models" + AZURE_CHAT, {"messages": MESSAGES}),
]


# ---- OpenAI and Azure usage ---------------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), OPENAI_STYLE)
@pytest.mark.parametrize(("cached", "expected"), [([0, 0, 0], 0), ([1, 1, 1], 1)])
def test_whole_answer_usage_has_cached_tokens(path, body, cached, expected):
    response = post(predict_app(CachingService(cached)), path, body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"] == _usage(expected)


@pytest.mark.parametrize(("path", "body"), OPENAI_STYLE[2:])
def test_streamed_usage_chunk_has_cached_tokens(path, body):
    response = post(predict_app(CachingService([2, 2, 2])), path, {**body, "stream": True})
    assert response.status_code == 200, response.text
    *chunks, last = _sent(response)
    assert last["usage"] == _usage(2)
    assert not any("usage" in chunk for chunk in chunks)


@pytest.mark.parametrize(("path", "body"), OPENAI_STYLE[:2])
def test_openai_streams_usage_only_when_asked_in_a_chunk_of_its_own(path, body):
    app = predict_app(CachingService([2, 2, 2]))
    for options in ({}, {"stream_options": {"include_usage": False}}):
        unasked = _sent(post(app, path, {**body, **options, "stream": True}))
        assert not any("usage" in chunk or chunk["choices"] == [] for chunk in unasked)
    asked = {**body, "stream": True, "stream_options": {"include_usage": True}}
    *chunks, finish, usage = _sent(post(app, path, asked))
    assert usage["choices"] == [] and usage["usage"] == _usage(2)
    assert finish["choices"][0]["finish_reason"] and "usage" not in finish
    assert usage["id"] == finish["id"] and usage["object"] == finish["object"]
    assert not any("usage" in chunk for chunk in chunks)


@pytest.mark.parametrize(("path", "body"), OPENAI_STYLE[:3])
def test_usage_takes_the_latest_event_with_a_token(path, body):
    """A migrated request's new pair reports its own figure: the answer shows the last one."""
    response = post(predict_app(CachingService([2, 2, 1])), path, body)
    assert response.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}


def test_completion_ignores_tokenless_events_and_caps_at_the_prompt():
    answer = Completion("chat", "m", 4, prompt_details=True)
    answer.add(_event("r", 10, 4, 1, None, 3))
    answer.add(_event("r", None, 4, 1, FinishReason.STOP, 0))  # an end without a token
    assert answer.usage["prompt_tokens_details"] == {"cached_tokens": 3}
    answer.add(_event("r", 11, 4, 2, None, 9))  # more than the prompt: a continued request
    assert answer.usage["prompt_tokens_details"] == {"cached_tokens": 4}


def test_completion_without_prompt_details_keeps_the_plain_usage():
    answer = Completion("text", "m", 4)
    answer.add(_event("r", 10, 4, 1, FinishReason.LENGTH, 3))
    assert answer.usage == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}


def test_openai_client_reads_cached_tokens():
    async def run() -> tuple[Any, Any]:
        transport = httpx.ASGITransport(app=predict_app(CachingService([1, 1, 1])))
        async with openai.AsyncOpenAI(
            base_url="http://door/v1",
            api_key="unused",
            max_retries=0,
            http_client=httpx.AsyncClient(transport=transport),
        ) as client:
            reply = await client.chat.completions.create(model="fake", messages=MESSAGES)
            stream = await client.chat.completions.create(
                model="fake",
                messages=MESSAGES,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            return reply, chunks[-1]

    reply, last = asyncio.run(run())
    assert reply.usage.prompt_tokens_details.cached_tokens == 1
    assert last.usage.prompt_tokens_details.cached_tokens == 1


def test_azure_client_reads_cached_tokens():
    with serving(predict_app(CachingService([2, 2, 2]))) as url:
        client = ChatCompletionsClient(endpoint=url, credential=AzureKeyCredential("unused"))
        reply = client.complete(messages=[UserMessage("hi")])
        updates = list(client.complete(messages=[UserMessage("hi")], stream=True))
    assert reply.usage.prompt_tokens == PROMPT_TOKENS
    assert reply.usage["prompt_tokens_details"] == {"cached_tokens": 2}
    assert updates[-1].usage["prompt_tokens_details"] == {"cached_tokens": 2}


# ---- MindIE /infer details ----------------------------------------------------------------


def _details(cached: int, tokens: int = 3) -> dict[str, Any]:
    return {
        "finish_reason": "length",
        "generated_tokens": tokens,
        "seed": 7,
        "cached_tokens": cached,
    }


@pytest.mark.parametrize("path", ["/infer", "/infer_token"])
def test_infer_details_have_cached_tokens(path):
    body: dict[str, Any] = {"parameters": {"seed": 7, "details": True}}
    body |= {"inputs": "hi"} if path == "/infer" else {"input_id": [104, 105]}
    response = post(predict_app(CachingService([2, 2, 1])), path, body)
    assert response.status_code == 200, response.text
    assert response.json()["details"] == _details(1)
    plain = post(predict_app(CachingService([2, 2, 2])), path, {**body, "parameters": {}})
    assert "details" not in plain.json()


@pytest.mark.parametrize("path", ["/infer", "/infer_token"])
def test_infer_stream_last_event_details_have_cached_tokens(path):
    body: dict[str, Any] = {"stream": True, "parameters": {"seed": 7, "details": True}}
    body |= {"inputs": "hi"} if path == "/infer" else {"input_id": [104, 105]}
    response = post(predict_app(CachingService([2, 2, 2])), path, body)
    *tokens, last = _sent(response)
    assert last["details"] == _details(2)
    assert all("details" not in event for event in tokens)
    plain = post(predict_app(CachingService([2, 2, 2])), path, {**body, "parameters": {}})
    assert _sent(plain)[-1]["details"] is None


def test_infer_answer_ignores_tokenless_events():
    answer = InferAnswer(seed=7, details=True, full_text=False, started_at=time.monotonic())
    answer.add(_event("r", 10, 5, 1, None, 4))
    answer.add(_event("r", None, 5, 1, FinishReason.EOS, 0))
    assert answer.body()["details"] == {
        "finish_reason": "eos_token",
        "generated_tokens": 1,
        "seed": 7,
        "cached_tokens": 4,
    }


# ---- /metrics -----------------------------------------------------------------------------


def _load(role: str, pid: int, queries: int, hits: int, blocks: int = 0) -> WorkerLoad:
    stats = EngineStats(
        num_cached_blocks=blocks, prefix_cache_queries=queries, prefix_cache_hits=hits
    )
    return WorkerLoad(role, 0, pid, stats)


def _cache(metrics: Metrics, role: str = "prefill") -> tuple[float | None, ...]:
    labels = {"model_name": "m", "role": role, "instance": "0"}
    return tuple(
        metrics.registry.get_sample_value(name, labels)
        for name in ("prefix_cache_queries_total", "prefix_cache_hits_total")
    )


def test_prefix_cache_counters_follow_the_polled_figures():
    metrics = Metrics("m")
    metrics.record_loads([_load("prefill", 11, 100, 40, blocks=3), _load("decode", 12, 0, 0)])
    assert _cache(metrics) == (100, 40)
    assert _cache(metrics, "decode") == (0, 0)  # every worker has its series from the start
    metrics.record_loads([_load("prefill", 11, 150, 70, blocks=5)])
    assert _cache(metrics) == (150, 70)
    labels = {"model_name": "m", "role": "prefill", "instance": "0"}
    assert metrics.registry.get_sample_value("worker_num_cached_blocks", labels) == 5


def test_a_restarted_worker_never_makes_a_counter_go_backwards():
    metrics = Metrics("m")
    metrics.record_loads([_load("prefill", 11, 150, 70)])
    metrics.record_loads([_load("prefill", 12, 10, 5)])  # a new process, counting from zero
    assert _cache(metrics) == (160, 75)
    metrics.record_loads([_load("prefill", 12, 20, 6)])
    assert _cache(metrics) == (170, 76)
    metrics.record_loads([_load("prefill", 13, 500, 400)])  # restarted and busy between polls
    assert _cache(metrics) == (670, 476)


def test_a_lower_figure_from_the_same_process_adds_nothing():
    """A load answered with an earlier step's stats: no rise until the figure passes the last."""
    metrics = Metrics("m")
    metrics.record_loads([_load("prefill", 11, 100, 40)])
    metrics.record_loads([_load("prefill", 11, 90, 30)])
    assert _cache(metrics) == (100, 40)
    metrics.record_loads([_load("prefill", 11, 120, 50)])
    assert _cache(metrics) == (120, 50)


def test_exposition_types_labels_and_promtool():
    metrics = Metrics("m")
    metrics.record_loads([_load("prefill", 11, 100, 40, blocks=3), _load("decode", 12, 8, 8)])
    text = metrics.exposition().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("prefix_cache_queries", "prefix_cache_hits"):
        assert families[name].type == "counter"
        samples = [s for s in families[name].samples if s.name == f"{name}_total"]
        assert {tuple(sorted(s.labels)) for s in samples} == {("instance", "model_name", "role")}
        assert {s.labels["role"] for s in samples} == {"prefill", "decode"}
    assert families["worker_num_cached_blocks"].type == "gauge"
    require(shutil.which("promtool"), "promtool (Debian's prometheus; .ci/run installs it)")
    check = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


# ---- the dashboard ------------------------------------------------------------------------


def _panel(title: str) -> dict:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    (panel,) = [p for p in panels if p["title"] == title]
    return panel


def test_hit_rate_panel_is_hits_over_queries_in_percent_per_worker():
    panel = _panel("Prefix cache hit rate")
    (target,) = panel["targets"]
    expr = target["expr"]
    assert metric_names(expr) == {"prefix_cache_hits_total", "prefix_cache_queries_total"}
    hits, queries = expr.split(" / ")
    for side, name in ((hits, "prefix_cache_hits_total"), (queries, "prefix_cache_queries_total")):
        selector = '{model_name=~"$model_name", instance=~"$coordinator"}'
        assert f"rate({name}{selector}[$__rate_interval])" in side
        assert re.search(r"by \([^)]*\brole\b[^)]*\binstance\b[^)]*\)", side), side
    assert hits.startswith("100 * ")
    assert panel["fieldConfig"]["defaults"]["unit"] == "percent"
    assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    blocks = _panel("Prefix-cached KV blocks per worker")
    assert metric_names(blocks["targets"][0]["expr"]) == {"worker_num_cached_blocks"}


def test_hit_rate_query_evaluates_to_the_hit_share(tmp_path: Path):
    """The panel's query, run by promtool on two workers' series: 25 % and 50 %, whatever the
    coordinator's own ``instance`` label (the worker's arrives as ``exported_instance``)."""
    require(shutil.which("promtool"), "promtool (Debian's prometheus; .ci/run installs it)")
    expr = _panel("Prefix cache hit rate")["targets"][0]["expr"]
    expr = expr.replace("$model_name", "m").replace("$__rate_interval", "5m")
    expr = expr.replace("$coordinator", ".*")  # every coordinator
    worker = 'model_name="m",instance="c:1028",exported_instance="{}",role="prefill"'
    series = {
        ("prefix_cache_hits_total", "0"): "0+30x10",
        ("prefix_cache_queries_total", "0"): "0+120x10",
        ("prefix_cache_hits_total", "1"): "0+50x10",
        ("prefix_cache_queries_total", "1"): "0+100x10",
    }
    case = {
        "interval": "1m",
        "input_series": [
            {"series": f"{name}{{{worker.format(i)}}}", "values": values}
            for (name, i), values in series.items()
        ],
        "promql_expr_test": [
            {
                "expr": expr,
                "eval_time": "10m",
                "exp_samples": [
                    {"labels": "{" + worker.format(i) + "}", "value": value}
                    for i, value in (("0", 25), ("1", 50))
                ],
            }
        ],
    }
    path = tmp_path / "hit_rate_test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [], "tests": [case]}))
    result = subprocess.run(
        ["promtool", "test", "rules", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
