"""The engine's own rate on a served workload: ``streams`` closed-loop requests run in the engine
itself, with no server, client or worker around it, each stream sending a fresh prompt when its
last answer ended, as the served stream's clients do (``benchmarks.serving.served_stream``).

A decode step of ``streams`` sequences (``step_probe``) is the rate of decoding alone; a served
closed loop also computes a prompt for every answer, in the same steps. This is the rate the
engine reaches on that mix: what a server in front of it, on the same cores, streams at best.

    run = run_closed_loop(engine, PromptDraw(7), streams=32, prompt_tokens=100,
                          new_tokens=128)
    run.tokens_per_s
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from benchmarks.engine.measures import PromptDraw
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def first_answer_tokens(stream: int, streams: int, new_tokens: int) -> int:
    """Stream ``stream``'s first answer: ``(stream + 1) / streams`` of an answer's length, so
    that the streams are spread over it from their second request on."""
    return max(1, new_tokens * (stream + 1) // streams)


@dataclass(frozen=True)
class LoopRun:
    tokens: int  # produced within the timed steps
    seconds: float
    answers: int  # requests that ended within them

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def run_closed_loop(
    engine: LLMEngine,
    draw: PromptDraw,
    streams: int,
    prompt_tokens: int,
    new_tokens: int,
    steps: int | None = None,
) -> LoopRun:
    """``streams`` closed-loop streams of fresh ``prompt_tokens``-token prompts and
    ``new_tokens``-token greedy answers (first answers shortened, ``first_answer_tokens``),
    timed over ``steps`` engine steps (default: half an answer's length) once every stream has
    had its first token. Every token counts, a prompt's first one too; the requests still
    running at the end are aborted."""
    serial = itertools.count()
    stream_of: dict[str, int] = {}
    ended = [0]

    def send(stream: int, tokens: int) -> None:
        request_id = f"loop{next(serial)}"
        params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
        engine.add_request(engine.request(request_id, draw.prompt(prompt_tokens), params))
        stream_of[request_id] = stream

    def step() -> int:
        events = engine.step()
        for event in events:
            if event.finished:
                ended[0] += 1
                send(stream_of.pop(event.request_id), new_tokens)
        return sum(event.token_id is not None for event in events)

    for stream in range(streams):
        send(stream, first_answer_tokens(stream, streams, new_tokens))
    try:
        while engine.scheduler.waiting or _prefilling(engine):
            step()
        start, tokens, ended[0] = time.perf_counter(), 0, 0
        for _ in range(steps or max(1, new_tokens // 2)):
            tokens += step()
        return LoopRun(tokens, time.perf_counter() - start, ended[0])
    finally:
        for request_id in stream_of:
            engine.abort(request_id)
        while engine.has_work():
            engine.step()


def _prefilling(engine: LLMEngine) -> bool:
    """Whether a running request has not had its first token yet."""
    return any(r.num_output_tokens == 0 for r in engine.scheduler.running)
