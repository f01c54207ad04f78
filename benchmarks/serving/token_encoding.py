"""What a token channel's step message costs to encode and decode, per event: the msgpack
encoding of ``workers/token_wire.py`` against pickling the list of ``TokenEvent`` (what Ray does
with a stream's items), for steps of 1 to 256 events.

    python -m benchmarks.serving.token_encoding            # a JSON object on stdout
    python -m benchmarks.serving.token_encoding --repeat 200

Each figure is the best of ``--rounds`` rounds of ``--repeat`` encode+decode round trips of one
step, in microseconds per event, with the frame's bytes per event. One process, one thread: it
measures the encoding alone, not the sockets.
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
from collections.abc import Callable
from typing import Any

from engine.outputs import TokenEvent
from engine.request import FinishReason
from workers.token_wire import StepMsg, decode, encode

STEP_SIZES = (1, 8, 64, 256)


def step_events(count: int) -> list[TokenEvent]:
    """``count`` events as a decode step makes them (the last one finished)."""
    events = [
        TokenEvent(f"cmpl-{i:08x}-0", 1000 + i, " word", 120, 17, 5000.0 + i, None, None, "", 16)
        for i in range(count)
    ]
    events[-1].finish_reason = FinishReason.LENGTH
    return events


def _msgpack(events: list[TokenEvent]) -> bytes:
    frame = encode(StepMsg(0, events))
    decode(frame)
    return frame


def _pickle(events: list[TokenEvent]) -> bytes:
    frame = pickle.dumps(events, protocol=5)
    pickle.loads(frame)
    return frame


CODECS: dict[str, Callable[[list[TokenEvent]], bytes]] = {"msgpack": _msgpack, "pickle": _pickle}


def measure(
    codec: Callable[[list[TokenEvent]], bytes], count: int, repeat: int, rounds: int
) -> tuple[float, float]:
    """(best microseconds per event of an encode+decode, bytes per event)."""
    events = step_events(count)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(repeat):
            frame = codec(events)
        best = min(best, (time.perf_counter() - started) / repeat)
    return best * 1e6 / count, len(frame) / count


def run(repeat: int, rounds: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for count in STEP_SIZES:
        row = {}
        for name, codec in CODECS.items():
            us, size = measure(codec, count, repeat, rounds)
            row[name] = {"us_per_event": round(us, 3), "bytes_per_event": round(size, 1)}
        result[f"{count}_events"] = row
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2000, help="round trips per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (the best one counts)")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.repeat, args.rounds), indent=2))


if __name__ == "__main__":
    main()
