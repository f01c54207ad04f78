"""What each door's stream costs the coordinator per token event, apart from the sockets: a
request's events (as the token channel hands them over) through the door's own answer
(``raising_failures``, the door's accumulation and content checks, its SSE/JSON framing), with
every event's JSON written by orjson (what the doors use) and by the standard library's
``json.dumps`` (what they used), side by side in paired rounds.

    python -m benchmarks.serving.door_framing           # benchmarks/results/door_framing.json
    python -m benchmarks.serving.door_framing --scratch --rounds 5 --repeat 20

Doors: MindIE ``/infer`` (token pieces, and ``fullTextEnabled``, whose every event carries the
whole text so far), TGI ``generate_stream``, OpenAI ``/v1/completions`` and
``/v1/chat/completions`` (whose chunks Azure's ``/chat/completions`` stream too). A request is
``--tokens`` events of a 5-character piece each, the last one finished. Each side's figure in a
round is the best of ``--repeat`` requests, in microseconds of one thread's CPU per event; the
ratio is orjson / stdlib, judged against ``<= 1`` (orjson kept only where it measures faster).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncGenerator, Callable
from functools import partial
from typing import Any

from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS, DEFAULT_WARMUP, paired_rounds, summarize
from benchmarks.harness.stats import Goal, judge
from coordinator.api import sse
from coordinator.api.common import Answer, raising_failures
from coordinator.api.mindie_format import InferAnswer
from coordinator.api.openai_format import Completion
from coordinator.api.tgi import TgiAnswer
from engine.outputs import TokenEvent
from engine.request import FinishReason

DOORS: dict[str, Callable[[], Answer]] = {
    "infer": lambda: InferAnswer(1, details=True, full_text=False, started_at=time.monotonic()),
    "infer_full_text": lambda: InferAnswer(1, True, full_text=True, started_at=time.monotonic()),
    "tgi": lambda: TgiAnswer(1, special_ids={0}, listed=False),
    "openai_completions": lambda: Completion("text", "pdserve", 100),
    "openai_chat": lambda: Completion("chat", "pdserve", 100, prompt_details=True),
}
ENCODERS: dict[str, Callable[[Any], bytes]] = {
    "orjson": sse.dumps,
    "stdlib": lambda value: json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode(),
}
NOT_SLOWER = Goal(1.0, at_least=False)


def request_events(num_tokens: int) -> list[TokenEvent]:
    """A request's events: one token each, 5 characters of text, the last finished."""
    events = [
        TokenEvent("cmpl-0", 1000 + i, " word", 100, i + 1, 0.0, num_cached_tokens=16)
        for i in range(num_tokens)
    ]
    events[-1].finish_reason = FinishReason.LENGTH
    return events


async def _served(events: list[TokenEvent]) -> AsyncGenerator[TokenEvent, None]:
    for event in events:
        yield event


async def _one_request(door: Callable[[], Answer], events: list[TokenEvent]) -> int:
    """Bytes of one request's stream, as ``open_stream`` and the door make it."""
    stream = raising_failures(_served(events))
    first = await anext(stream)
    size = sum([len(chunk) async for chunk in door().stream(first, stream)])
    await asyncio.sleep(0)  # the generators a finished stream left are closed, as a server does
    return size


def best_us_per_event(door: Callable[[], Answer], events: list[TokenEvent], repeat: int) -> float:
    """The best of ``repeat`` requests through ``door``: CPU µs per event."""
    loop = asyncio.new_event_loop()
    try:
        best = float("inf")
        for _ in range(repeat):
            started = time.thread_time()
            loop.run_until_complete(_one_request(door, events))
            best = min(best, time.thread_time() - started)
    finally:
        loop.close()
    return best * 1e6 / len(events)


def us_per_event(door: str, encoder: str, events: list[TokenEvent], repeat: int) -> float:
    """The best of ``repeat`` requests through ``door`` with ``encoder``: CPU µs per event."""
    sse.dumps = ENCODERS[encoder]  # type: ignore[assignment]
    try:
        return best_us_per_event(DOORS[door], events, repeat)
    finally:
        sse.dumps = ENCODERS["orjson"]  # type: ignore[assignment]


def run(num_tokens: int, repeat: int, rounds: int, warmup: int) -> dict[str, Any]:
    events = request_events(num_tokens)
    result: dict[str, Any] = {}
    for door in DOORS:
        sides = {e: partial(us_per_event, door, e, events, repeat) for e in ENCODERS}
        kept = paired_rounds(sides, rounds, warmup)
        summary = summarize(kept, "orjson", "stdlib", digits=3)
        verdict = judge(summary["ratio"]["rounds"], NOT_SLOWER)
        summary["verdict"] = {"goal": str(NOT_SLOWER), "verdict": verdict.verdict}
        result[door] = summary
        print(f"{door}: orjson {summary['orjson']['median']} µs/event, stdlib "
              f"{summary['stdlib']['median']}, ratio {summary['ratio']['median']} "
              f"[{summary['ratio']['low']}-{summary['ratio']['high']}] {verdict}",
              file=sys.stderr)  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="events per request")
    parser.add_argument("--repeat", type=int, default=50, help="requests per side and round")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="dropped rounds")
    add_output_arguments(parser, "door_framing")
    args = parser.parse_args(argv)
    result = ResultFile.start(args, argv)
    doors = run(args.tokens, args.repeat, args.rounds, args.warmup)
    settings = {"tokens": args.tokens, "repeat": args.repeat, "rounds": args.rounds}
    print(result.write({"settings": settings, "doors": doors}))


if __name__ == "__main__":
    main()
