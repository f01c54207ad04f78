"""What the Responses and Messages doors, and log probabilities, cost the coordinator per token
against the chat door's stream, side by side in paired rounds.

    python -m benchmarks.serving.door_costs           # benchmarks/results/door_costs.json
    python -m benchmarks.serving.door_costs --scratch --rounds 5 --repeat 20

Each comparison streams one request's token events (as the token channel hands them over)
through a door's own answer (``raising_failures``, the door's accumulation and content checks,
its SSE framing; ``benchmarks/serving/door_framing.py`` runs the same way) and takes the best of
``--repeat`` requests, in µs of one thread's CPU per event:

- ``responses`` / ``chat``: ``/v1/responses`` against ``/v1/chat/completions`` (goal <= 1.05);
- ``messages`` / ``chat``: ``/v1/messages`` against it (goal <= 1.05);
- ``chat_logprobs`` / ``chat``: chat with ``logprobs`` and ``top_logprobs: 5`` (every event
  carrying its six figures, the tokens' texts cached as the served model caches them) against
  none: the coordinator's share of the logprobs' cost, in µs a token; no goal of its own (the
  goal is on the time per output token, which ``benchmarks/engine/logprobs_cost.py`` takes
  with this figure added).

A goal is met only where the ratio's 95 % interval lies under it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS, DEFAULT_WARMUP, paired_rounds, summarize
from benchmarks.harness.stats import Goal, judge
from benchmarks.serving.door_framing import best_us_per_event
from coordinator.api.anthropic_format import MessageAnswer
from coordinator.api.common import Answer
from coordinator.api.openai_format import Completion
from coordinator.api.responses_format import ResponseAnswer
from engine.outputs import TokenEvent, TokenLogprobs
from engine.request import FinishReason

GOAL = Goal(1.05, at_least=False)
TOP = 5


class CachedTexts:
    """Tokens' texts by id, remembered (``ModelInfo.token_text``'s way) after the first."""

    def __init__(self) -> None:
        self.texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.texts.get(token_id)
        if text is None:
            text = self.texts[token_id] = f" w{token_id}"
        return text


def _chat(logprobs: bool = False) -> Answer:
    answer = Completion("chat", "pdserve", 100, prompt_details=True)
    if logprobs:
        answer.token_text = TEXTS
    return answer


TEXTS = CachedTexts()
DOORS: dict[str, Callable[[], Answer]] = {
    "chat": _chat,
    "responses": lambda: ResponseAnswer({"model": "pdserve"}, 100),
    "messages": lambda: MessageAnswer("pdserve", 100, None),
    "chat_logprobs": partial(_chat, logprobs=True),
}
COMPARISONS = (("responses", "chat"), ("messages", "chat"), ("chat_logprobs", "chat"))


def request_events(num_tokens: int, logprobs: bool) -> list[TokenEvent]:
    """One token an event, 5 characters of text, the last finished; with ``logprobs``, each
    with its log probability and ``TOP`` alternatives."""
    events = []
    for i in range(num_tokens):
        figures = None
        if logprobs:
            top = tuple((1000 + (i + k) % 500, -0.5 - k) for k in range(TOP))
            figures = TokenLogprobs(-0.5, top)
        events.append(TokenEvent("r", 1000 + i % 500, " word", 100, i + 1, 0.0,
                                 num_cached_tokens=16, logprobs=figures))  # fmt: skip
    events[-1].finish_reason = FinishReason.LENGTH
    return events


def us_per_event(door: str, events: list[TokenEvent], repeat: int) -> float:
    """The best of ``repeat`` requests through ``door``: CPU µs per event."""
    return best_us_per_event(DOORS[door], events, repeat)


def run(num_tokens: int, repeat: int, rounds: int, warmup: int) -> dict[str, Any]:
    plain, with_logprobs = request_events(num_tokens, False), request_events(num_tokens, True)
    result: dict[str, Any] = {}
    for ours, theirs in COMPARISONS:
        sides = {
            door: partial(us_per_event, door, with_logprobs if door == "chat_logprobs" else plain,
                          repeat)
            for door in (ours, theirs)
        }  # fmt: skip
        kept = paired_rounds(sides, rounds, warmup)
        summary = summarize(kept, ours, theirs, digits=3)
        verdict = judge(summary["ratio"]["rounds"], GOAL)
        if ours == "chat_logprobs":
            added = [a - b for a, b in zip(kept[ours], kept[theirs], strict=True)]
            summary["added_us_per_token"] = round(sorted(added)[len(added) // 2], 3)
        else:
            summary["verdict"] = {"goal": str(GOAL), "verdict": verdict.verdict}
        result[f"{ours}/{theirs}"] = summary
        print(f"{ours}/{theirs}: {summary[ours]['median']} / {summary[theirs]['median']} µs/event,"
              f" ratio {summary['ratio']['median']} [{summary['ratio']['low']}-"
              f"{summary['ratio']['high']}] {verdict}", file=sys.stderr)  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="events per request")
    parser.add_argument("--repeat", type=int, default=50, help="requests per side and round")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="dropped rounds")
    add_output_arguments(parser, "door_costs")
    args = parser.parse_args(argv)
    result = ResultFile.start(args, argv)
    comparisons = run(args.tokens, args.repeat, args.rounds, args.warmup)
    settings = {"tokens": args.tokens, "repeat": args.repeat, "rounds": args.rounds,
                "top_logprobs": TOP}  # fmt: skip
    print(result.write({"settings": settings, "comparisons": comparisons}))


if __name__ == "__main__":
    main()
