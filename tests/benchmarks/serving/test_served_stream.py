"""The served-stream benchmark's pure parts: which sides a round measures, the streams spread
over an answer's length, the window's token count, the latencies of full-length answers, the
goals' per-round ratios and verdicts, the rendered Markdown; and the TGI and Azure doors of the
harness client against a stand-in server."""

from __future__ import annotations

import asyncio
import json

import httpx

from benchmarks import report
from benchmarks.harness.client import Target, send
from benchmarks.harness.load import ABANDONED, ClosedLoop
from benchmarks.harness.record import RequestRecord
from benchmarks.serving.served_stream import (
    TokenClock,
    door_concurrency,
    first_answer_tokens,
    gaps_within,
    side_names,
    stream_figures,
)
from benchmarks.serving.served_stream_report import goal_rows, render, summarize_sides
from benchmarks.serving.workload import WorkItem


def test_the_openai_door_at_every_n_the_others_at_the_lowest_and_highest():
    assert door_concurrency("openai", [1, 8, 32]) == [1, 8, 32]
    assert door_concurrency("tgi", [1, 8, 32]) == [1, 32]
    names = side_names(["pd_separate"], ["openai", "infer"], [1, 8, 32], llama=True)
    assert names == [
        "engine/pd_separate/1",
        "engine/pd_separate/32",
        "served/pd_separate/openai/1",
        "served/pd_separate/openai/8",
        "served/pd_separate/openai/32",
        "served/pd_separate/infer/1",
        "served/pd_separate/infer/32",
        "llama_server/1",
        "llama_server/8",
        "llama_server/32",
    ]
    assert "llama_server/1" not in side_names(["single_node"], ["openai"], [1], llama=False)


def test_the_engines_closed_loop_is_measured_where_the_decoding_actor_prefills():
    names = side_names(["single_node", "pd_separate"], ["openai"], [1, 32], llama=False)
    assert "engine_loop/single_node/32" in names
    assert not any(name.startswith("engine_loop/pd_separate") for name in names)


def test_first_answers_spread_the_streams_over_an_answers_length():
    assert [first_answer_tokens(s, 4, 128) for s in range(4)] == [32, 64, 96, 128]
    assert first_answer_tokens(0, 1, 128) == 128
    assert first_answer_tokens(0, 32, 16) == 1  # never an empty answer


def test_the_window_counts_the_token_events_that_arrived_in_it():
    clock = TokenClock("completions")
    clock.arrivals = [0.5, 1.0, 1.5, 2.5]
    assert clock.within(1.0, 2.0) == 2
    clock.on_event(3, {"choices": [{"text": "a", "finish_reason": None}]})
    clock.on_event(4, {"choices": [], "usage": {"completion_tokens": 3}})  # no token
    assert len(clock.arrivals) == 5 and clock.streams == {3}
    assert clock.wait_for(1, timeout_s=5) < 5


def test_ttft_comes_from_requests_sent_after_the_first_prefills_tpot_from_the_window():
    full = RequestRecord(100, 8, 2.0, 0.2, 0.9, 8, [0.1] * 7, finish_reason="length")
    early = RequestRecord(100, 4, 0.0, 1.0, 1.9, 4, [0.3] * 3, finish_reason="length")
    cut = RequestRecord(100, 8, 2.5, 0.4, None, 3, [0.2, 0.2], error=ABANDONED)
    failed = RequestRecord(100, 8, 3.0, error="HTTP 500")
    records = [full, early, cut, failed]
    figures = stream_figures(records, 8, tokens_per_s=40.0, since=1.0, window=(1.5, 3.5))
    assert figures["ttft_p50_ms"] == 300.0  # of full and cut: early came before the window
    assert figures["burst_ttft_p50_ms"] == 1000.0  # early's: a stream's first request
    # the gaps ending in the window: early's last two (300 ms), full's 7 (100), cut's 2 (200)
    assert round(figures["tpot_p50_ms"], 3) == 200.0 and figures["tpot_requests"] == 3
    assert figures["latency_requests"] == 2 and figures["tokens_per_request"] == 8
    assert figures["failed"] == 1 and figures["tokens_per_s"] == 40  # the abandoned one is not
    late = stream_figures(records, 8, tokens_per_s=40.0, since=1.0, window=(2.85, 3.5))
    assert round(late["tpot_p50_ms"], 3) == 150.0  # full's last gap ends at 2.9, cut's two


def test_gaps_count_where_their_token_arrived():
    record = RequestRecord(100, 8, 1.0, 0.5, None, 4, [0.1, 0.2, 0.3], error=ABANDONED)
    assert gaps_within(record, 1.6, 1.9) == [0.1, 0.2]  # tokens at 1.5, 1.6, 1.8, 2.1
    assert gaps_within(RequestRecord(100, 8, 1.0), 0, 9) == []  # no token yet


def test_the_closed_loop_counts_first_tokens_of_requests_in_flight_and_ended():
    loop = ClosedLoop.__new__(ClosedLoop)
    loop.records = [RequestRecord(100, 8, 0.5, 0.1), RequestRecord(100, 8, 2.0, 0.1)]
    loop._in_flight = {0: RequestRecord(100, 8, 3.0, 0.2), 1: RequestRecord(100, 8, 3.5)}
    assert loop.first_tokens_since(1.0) == 2  # not the one sent before, nor the one waiting


def kept_rounds(rounds: int = 5) -> dict[str, list[dict[str, float]]]:
    """A run where pdserve's TPOT is 1.1x the engine's step and it streams 1.4x llama-server."""
    served = {
        "tokens_per_s": 70.0,
        "ttft_p50_ms": 90.0,
        "tpot_p50_ms": 11.0,
        "cpu_ms_per_token:coordinator": 0.1,
    }
    return {
        "engine/single_node/1": [{"step_ms": 10.0, "tokens_per_s": 100.0}] * rounds,
        "engine/single_node/8": [{"step_ms": 100.0, "tokens_per_s": 80.0}] * rounds,
        "served/single_node/openai/1": [served] * rounds,
        "served/single_node/openai/8": [served] * rounds,
        "llama_server/1": [{"tokens_per_s": 50.0, "ttft_p50_ms": 100.0}] * rounds,
        "llama_server/8": [{"tokens_per_s": 50.0, "ttft_p50_ms": 100.0}] * rounds,
    }


def test_goals_are_ratios_within_rounds_judged_by_their_interval():
    rows = {
        (r["goal"], r["n"]): r
        for r in goal_rows(kept_rounds(), ["single_node"], ["openai"], [1, 8])
    }
    assert rows[("tpot_over_engine_step", 1)]["figure"]["median"] == 1.1
    assert rows[("tpot_over_engine_step", 1)]["verdict"].startswith("met")
    assert rows[("coordinator_cpu_ms_per_token", 8)]["verdict"].startswith("met")
    assert rows[("rate_over_engine", 8)]["verdict"].startswith("missed")  # 70 / 80
    assert rows[("openai_over_llama_server", 1)]["verdict"].startswith("met")  # 1.4 >= 1.2
    assert rows[("openai_over_llama_server", 8)]["verdict"].startswith("missed")  # 1.4 < 1.5
    assert rows[("ttft_over_llama_server", 1)]["bound"] == "<= 1x"
    few = goal_rows(kept_rounds(2), ["single_node"], ["openai"], [1, 8])
    assert all(r["verdict"].startswith("undecided") for r in few)


def test_the_rate_over_the_engines_closed_loop_is_a_figure_with_no_goal():
    kept = kept_rounds() | {"engine_loop/single_node/8": [{"tokens_per_s": 70.0}] * 5}
    rows = {(r["goal"], r["n"]): r for r in goal_rows(kept, ["single_node"], ["openai"], [1, 8])}
    loop = rows[("rate_over_engine_loop", 8)]
    assert loop["figure"]["median"] == 1.0 and loop["verdict"] == "-" and loop["bound"] == "-"


def test_a_goal_whose_sides_were_not_measured_is_left_out():
    kept = kept_rounds()
    del kept["llama_server/1"], kept["llama_server/8"]
    goals = {r["goal"] for r in goal_rows(kept, ["single_node"], ["openai"], [1, 8])}
    assert goals == {"tpot_over_engine_step", "coordinator_cpu_ms_per_token", "rate_over_engine"}


def test_the_report_renders_the_sides_and_the_goals():
    kept = kept_rounds()
    data = {
        "_meta": {"cpu": "test CPU", "commit": "abc", "rounds": 5, "dropped_rounds": 1},
        "settings": {"new_tokens": 128, "prompt_tokens": 100, "window_s": 6, "lead_s": 2},
        "sides": summarize_sides(kept),
        "goals": goal_rows(kept, ["single_node"], ["openai"], [1, 8]),
    }
    text = report.RENDERERS["served_stream"](json.loads(json.dumps(data)))
    assert "*test CPU" in text
    assert "| served/single_node/openai/8 | 70.0 [70.0-70.0] |" in text
    assert "| engine/single_node/1 | 100.0 [100.0-100.0] | - | - | 10.0 [10.0-10.0] |" in text
    assert "| tpot_over_engine_step | single_node | openai | 1 | **1.100 [1.100-1.100]** |" in text
    assert render(data).startswith("5 kept rounds")


def door_server(request: httpx.Request) -> httpx.Response:
    """TGI's ``data:`` events (no space), or Azure's chat chunks when asked right."""
    if request.url.path == "/generate_stream":
        token = {"token": {"id": 1, "text": "a"}, "generated_text": None, "details": None}
        last = {**token, "generated_text": "aa", "details": {"finish_reason": "length"}}
        body = "".join(f"data:{json.dumps(e)}\n\n" for e in (token, last))
        return httpx.Response(200, content=body.encode())
    assert (
        request.url.params["api-version"] and request.headers["extra-parameters"] == "pass-through"
    )
    assert json.loads(request.content)["ignore_eos"] is True
    chunks = [
        {"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]},
        {"choices": [{"delta": {"content": "a"}, "finish_reason": None}]},
        {"choices": [{"delta": {"content": "b"}, "finish_reason": "length"}]},
        {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 9}},
    ]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, content=body.encode())


def test_the_tgi_and_azure_doors_stream_to_a_finish():
    async def go(api: str) -> RequestRecord:
        transport = httpx.MockTransport(door_server)
        async with httpx.AsyncClient(transport=transport) as client:
            return await send(client, Target("http://test", api=api), WorkItem("hi", 2))

    tgi, azure = asyncio.run(go("tgi")), asyncio.run(go("azure"))
    assert tgi.ok and tgi.output_tokens == 2 and tgi.finish_reason == "length"
    assert azure.ok and azure.output_tokens == 2 and azure.served_prompt_tokens == 9
