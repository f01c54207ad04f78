"""The clients of ``bench_replicas``: an open loop of short streamed ``/v1/completions`` spread
over one or more coordinators, the shared-prefix chat mix with each user's turns going through
the coordinators in turn, and closed-loop clients kept going in a thread while a coordinator is
killed. Each request records when it was sent, its time to first token and whether it ended
with a normal finish; a failed one is kept with what went wrong (``detail``)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.harness.sse import sse_lines
from benchmarks.serving.prefix_chat import Encode, make_conversations, system_prompt
from benchmarks.serving.workload import WORDS

LIMITS = httpx.Limits(max_connections=1024, max_keepalive_connections=256)


@dataclass
class Sent:
    sent_at: float
    ok: bool = False
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    detail: str = ""


def short_prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def stream_completion(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], sent: Sent
) -> Sent:
    """``POST url/v1/completions`` streamed with usage: TTFT at the first token's chunk (its
    text may be empty: a byte-level token that completes no character yet), ok only on a
    normal finish, the usage's prompt and cached tokens."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.monotonic()
    finish = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                sent.detail = f"{response.status_code}: {(await response.aread())[:200]!r}"
                return sent
            async for line in sse_lines(response):
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    break
                event = json.loads(data)
                for choice in event.get("choices", []):
                    if choice.get("text") is not None and sent.ttft_s is None:
                        sent.ttft_s = time.monotonic() - start  # the first token's chunk
                    finish = choice.get("finish_reason") or finish
                usage = event.get("usage")
                if usage:
                    sent.prompt_tokens = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    sent.cached_tokens = details.get("cached_tokens") or 0
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
        sent.detail = f"{type(exc).__name__}: {exc}"[:300]
    sent.ok = finish in ("length", "stop")
    if not sent.ok and not sent.detail:
        sent.detail = f"finish {finish!r}"
    return sent


async def open_loop(
    urls: list[str], rate: float, seconds: float, seed: int, words: int, max_tokens: int
) -> tuple[list[Sent], float]:
    """Poisson arrivals at ``rate`` for ``seconds``, round-robin over ``urls``; the requests and
    the wall time until the last one ended. Prompts are ``seed``'s: a side given a seed of its
    own finds none of another side's prompts in the prefix cache."""
    rng = random.Random(f"open-{seed}-{rate}")
    body = {"model": "m", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    tasks, start, at, n = [], time.monotonic(), 0.0, 0
    async with httpx.AsyncClient(timeout=60, limits=LIMITS) as client:
        while at < seconds:
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            which = n % len(urls)
            prompt = {**body, "prompt": short_prompt(rng, words)}
            sent = Sent(time.monotonic() - start)
            tasks.append(
                asyncio.ensure_future(stream_completion(client, urls[which], prompt, sent))
            )
            at += rng.expovariate(rate)
            n += 1
        done = await asyncio.gather(*tasks)
    return list(done), time.monotonic() - start


async def chat_mix(
    urls: list[str],
    seed: int,
    encode: Encode,
    users: int,
    turns: int,
    system_tokens: int,
    concurrency: int,
    max_tokens: int,
) -> list[Sent]:
    """``users`` conversations over one system prompt, ``concurrency`` at a time; turn ``t`` of
    user ``u`` goes through coordinator ``(u + t) % len(urls)``, so with two coordinators every
    next turn arrives through the other one. Each turn is a ``/v1/chat/completions`` request,
    not streamed; the server renders the chat template."""
    system = system_prompt(system_tokens, encode, seed)
    conversations = make_conversations(users, turns, system, seed)
    gate = asyncio.Semaphore(concurrency)
    sent_all: list[Sent] = []
    body = {"model": "m", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}

    async def user(index: int, client: httpx.AsyncClient) -> None:
        async with gate:
            conversation = conversations[index]
            for turn in range(conversation.num_turns):
                which = (index + turn) % len(urls)
                sent = Sent(time.monotonic())
                request = {**body, "messages": conversation.messages(turn)}
                text = await chat_turn(client, urls[which], request, sent)
                sent_all.append(sent)
                conversation.add_answer(turn, text if sent.ok else "(no answer)")

    async with httpx.AsyncClient(timeout=120, limits=LIMITS) as client:
        await asyncio.gather(*(user(i, client) for i in range(users)))
    return sent_all


async def chat_turn(client: httpx.AsyncClient, url: str, body: dict[str, Any], sent: Sent) -> str:
    """One non-streamed chat turn: its text; ``sent`` gets ok, prompt and cached tokens."""
    try:
        response = await client.post(f"{url}/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        sent.detail = f"{type(exc).__name__}: {exc}"
        return ""
    if response.status_code != 200:
        sent.detail = f"{response.status_code}: {response.text[:200]}"
        return ""
    try:
        answer = response.json()
        usage = answer["usage"]
        sent.prompt_tokens = usage["prompt_tokens"]
        sent.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        finish = answer["choices"][0]["finish_reason"]
        text = answer["choices"][0]["message"]["content"] or ""
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        sent.detail = f"{type(exc).__name__}: {exc}"[:300]
        return ""
    sent.ok = finish in ("length", "stop")
    if not sent.ok:
        sent.detail = f"finish {finish!r}"
    return text


@dataclass
class ClosedLoop:
    """``clients`` closed-loop streamed completions against ``url`` in a thread, until stopped."""

    url: str
    clients: int
    max_tokens: int
    words: int = 24
    sent: list[Sent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        body = {"model": "m", "max_tokens": self.max_tokens, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=60, limits=LIMITS) as client:

            async def one(index: int) -> None:
                rng = random.Random(f"closed-{index}")
                while not self._stop.is_set():
                    sent = Sent(time.monotonic())
                    prompt = {**body, "prompt": short_prompt(rng, self.words)}
                    self.sent.append(await stream_completion(client, self.url, prompt, sent))
                    if not sent.ok:
                        await asyncio.sleep(0.05)  # a coordinator that is gone: do not spin

            await asyncio.gather(*(one(i) for i in range(self.clients)))

    def stop(self, timeout_s: float = 120) -> list[Sent]:
        self._stop.set()
        self._thread.join(timeout_s)
        return self.sent
