"""What the soak test sends: a seeded mix of requests over pdserve's front doors, each one a
``Plan`` that says where it goes, what body it carries and which fault (if any) it injects.

Kinds without a fault are plain requests that must succeed. The injected faults are a stream the
client closes after some events (``disconnect``), a whole answer the client stops waiting for
(``abandon``), a MindIE ``parameters.timeout`` short enough to expire (``timeout``) and a body the
server must refuse (``invalid``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from benchmarks.serving.workload import parse_mix as parse_weights

DOORS = {
    "infer": "/infer",
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "tgi": "/generate",
    "tgi_stream": "/generate_stream",
}
# kind: (door, stream, fault)
KINDS: dict[str, tuple[str, bool, str | None]] = {
    "infer_stream": ("infer", True, None),
    "infer_whole": ("infer", False, None),
    "chat_stream": ("chat", True, None),
    "chat_whole": ("chat", False, None),
    "completions_stream": ("completions", True, None),
    "completions_whole": ("completions", False, None),
    "tgi_generate": ("tgi", False, None),
    "tgi_generate_stream": ("tgi_stream", True, None),
    "disconnect_stream": ("", True, "disconnect"),
    "abandon_whole": ("", False, "abandon"),
    "timeout_infer": ("infer", False, "timeout"),
    "timeout_infer_stream": ("infer", True, "timeout"),
    "invalid_body": ("", False, "invalid"),
}
DEFAULT_MIX = {
    "infer_stream": 10,
    "infer_whole": 8,
    "chat_stream": 8,
    "chat_whole": 6,
    "completions_stream": 6,
    "completions_whole": 6,
    "tgi_generate": 8,
    "tgi_generate_stream": 4,
    "disconnect_stream": 12,
    "abandon_whole": 8,
    "timeout_infer": 4,
    "timeout_infer_stream": 4,
    "invalid_body": 10,
}
STREAM_DOORS = ("infer", "chat", "completions", "tgi_stream")
WHOLE_DOORS = ("infer", "chat", "completions", "tgi")
_TEXT = (
    "cache block prefill decode token stream river mountain city garden library winter summer "
    "engine signal paper music story quiet bright early late north south market harbour bridge "
    "window forest island 你好 世界 café naïve"
)
_WORDS = _TEXT.split(" ")


@dataclass(frozen=True)
class LoadShape:
    """Sizes of the generated requests."""

    max_tokens: int = 16  # plain requests ask for 1..max_tokens tokens
    long_tokens: int = 128  # requests that must still run when a fault hits them
    max_prompt_words: int = 24
    timeout_s: int = 1  # MindIE parameters.timeout of the timeout kinds (whole seconds, >= 1)
    timeout_tokens: int = 512  # what the timeout kinds ask for: enough to outlast timeout_s


@dataclass(frozen=True)
class Plan:
    kind: str
    door: str
    path: str
    body: dict[str, Any] | bytes  # bytes: sent as is (a malformed body)
    stream: bool
    fault: str | None = None
    close_after_events: int = 0  # disconnect: events read before the client closes
    abandon_after_s: float = 0.0  # abandon: how long the client waits for the answer


def parse_mix(text: str) -> dict[str, float]:
    """``kind=weight,...`` over ``KINDS``; an empty text is the default mix."""
    return parse_weights(text, tuple(KINDS)) if text else dict(DEFAULT_MIX)


def draw_plan(rng: random.Random, mix: dict[str, float], shape: LoadShape) -> Plan:
    """One request of a kind drawn from ``mix``."""
    kind = rng.choices(list(mix), weights=list(mix.values()))[0]
    door, stream, fault = KINDS[kind]
    prompt = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, shape.max_prompt_words)))
    if fault == "invalid":
        return _invalid_plan(rng, kind, prompt)
    if fault in ("disconnect", "abandon"):
        door = rng.choice(STREAM_DOORS if stream else WHOLE_DOORS)
    long = fault is not None
    tokens = rng.randint(shape.long_tokens // 2, shape.long_tokens) if long else 0
    tokens = tokens or rng.randint(1, shape.max_tokens)
    body = _body(door, prompt, tokens, stream, ignore_eos=long, rng=rng)
    if fault == "timeout":
        body["parameters"] |= {"timeout": shape.timeout_s, "max_new_tokens": shape.timeout_tokens}
    return Plan(
        kind,
        door,
        DOORS[door],
        body,
        stream,
        fault,
        close_after_events=rng.randint(0, 4),
        abandon_after_s=rng.uniform(0.01, 0.5),
    )


def _body(
    door: str, prompt: str, tokens: int, stream: bool, ignore_eos: bool, rng: random.Random
) -> dict[str, Any]:
    if door in ("infer", "tgi", "tgi_stream"):
        parameters: dict[str, Any] = {"max_new_tokens": tokens}
        if door == "infer":
            parameters |= {"priority": rng.randint(1, 5), "ignore_eos": ignore_eos}
            parameters["details"] = rng.random() < 0.5
        if rng.random() < 0.5:
            parameters |= {"temperature": 0.8, "top_p": 0.9, "seed": rng.randint(1, 2**31)}
        body: dict[str, Any] = {"inputs": prompt, "parameters": parameters}
        return body | {"stream": stream} if door == "infer" else body
    body = {"max_tokens": tokens, "stream": stream, "temperature": rng.choice((0, 0.7))}
    if ignore_eos:
        body["ignore_eos"] = True
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if door == "chat":
        return body | {"messages": [{"role": "user", "content": prompt}]}
    return body | {"prompt": prompt}


# door: bodies every server must refuse with a 4xx
_INVALID: dict[str, tuple[dict[str, Any] | bytes, ...]] = {
    "infer": (
        b'{"inputs": "hello", "parameters": {',
        b"[1, 2, 3]",
        {"inputs": "hello", "parameters": {"top_p": 1.0}},
        {"inputs": "hello", "parameters": {"priority": 9}},
        {"inputs": "hello", "parameters": {"max_new_tokens": 0}},
        {"inputs": "hello", "parameters": {"timeout": 0}},
        {"inputs": "", "stream": True},
    ),
    "chat": (
        b'{"messages": [',
        {"messages": []},
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 5},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0, "stream": True},
    ),
    "completions": (
        b"not json",
        {"prompt": "hi", "max_tokens": -1},
        {"prompt": "hi", "top_p": 2},
    ),
    "tgi": (
        b'{"inputs": ',
        {"inputs": "hello", "parameters": {"top_p": 1.0}},
        {"inputs": "hello", "parameters": {"max_new_tokens": 0}},
    ),
}


def _invalid_plan(rng: random.Random, kind: str, prompt: str) -> Plan:
    door = rng.choice(list(_INVALID))
    body = rng.choice(_INVALID[door])
    if isinstance(body, dict) and "inputs" in body and body["inputs"]:
        body = body | {"inputs": prompt}
    stream = isinstance(body, dict) and bool(body.get("stream"))
    return Plan(kind, door, DOORS[door], body, stream, "invalid")
