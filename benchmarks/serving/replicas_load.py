"""The workloads of ``benchmarks.serving.replicas``, on the harness's one load generator: an
open loop of short streamed ``/v1/completions`` spread over one or more coordinators, the
shared-prefix chat mix with each user's turns going through the coordinators in turn, and
closed-loop streams kept going while a coordinator is killed. Every request is a
:class:`~benchmarks.harness.record.RequestRecord`: ok only on a normal finish, a failed one kept
with its error."""

from __future__ import annotations

import asyncio
import random

import httpx

from benchmarks.harness.client import Target
from benchmarks.harness.load import LIMITS, ClosedLoop, arrival_times, round_robin, run_load
from benchmarks.harness.record import RequestRecord
from benchmarks.serving.prefix_chat import (
    Encode,
    make_conversations,
    system_prompt,
    take_turn,
)
from benchmarks.serving.workload import WORDS, WorkItem

MODEL = "m"  # pdserve answers any model name


def targets(urls: list[str], api: str = "completions") -> list[Target]:
    return [Target(url, api=api, model=MODEL) for url in urls]


def short_item(rng: random.Random, words: int, max_tokens: int) -> WorkItem:
    prompt = " ".join(rng.choice(WORDS) for _ in range(words))
    return WorkItem(prompt, max_tokens, "short", words)


async def open_loop(
    urls: list[str],
    rate: float,
    seconds: float,
    arrivals_seed: int,
    text_seed: int,
    words: int,
    max_tokens: int,
) -> tuple[list[RequestRecord], float]:
    """Poisson arrivals at ``rate`` for ``seconds``, round-robin over ``urls``; the records and
    the wall time until the last one ended. The arrivals are ``arrival_seed``'s (two sides given
    the same one get the same times); the prompts ``text_seed``'s (a side given a seed of its own
    finds none of another side's prompts in the prefix cache)."""
    arrivals = arrival_times(None, rate, seed=arrivals_seed, seconds=seconds)
    rng = random.Random(f"open-{text_seed}-{rate}")
    items = [short_item(rng, words, max_tokens) for _ in arrivals]
    async with httpx.AsyncClient(timeout=60, limits=LIMITS) as client:
        return await run_load(items, round_robin(client, targets(urls)), arrivals=arrivals)


async def chat_mix(
    urls: list[str],
    seed: int,
    encode: Encode,
    users: int,
    turns: int,
    system_tokens: int,
    concurrency: int,
    max_tokens: int,
) -> list[RequestRecord]:
    """``users`` conversations over one system prompt, ``concurrency`` at a time; turn ``t`` of
    user ``u`` goes through coordinator ``(u + t) % len(urls)``, so with two coordinators every
    next turn arrives through the other one. Each turn is a streamed ``/v1/chat/completions``
    request; the server renders the chat template."""
    system = system_prompt(system_tokens, encode, seed)
    conversations = make_conversations(users, turns, system, seed)
    gate = asyncio.Semaphore(concurrency)
    records: list[RequestRecord] = []
    chat = targets(urls, "chat")

    async def user(index: int, client: httpx.AsyncClient) -> None:
        async with gate:
            conversation = conversations[index]
            for turn in range(conversation.num_turns):
                target = chat[(index + turn) % len(urls)]
                record, _ = await take_turn(client, target, conversation, turn, max_tokens)
                records.append(record)

    async with httpx.AsyncClient(timeout=120, limits=LIMITS) as client:
        await asyncio.gather(*(user(i, client) for i in range(users)))
    return records


def streams(url: str, clients: int, max_tokens: int, words: int = 24) -> ClosedLoop:
    """``clients`` closed-loop streamed completions against ``url``, in a thread until stopped."""

    def make_item(stream: int, turn: int) -> WorkItem:
        return short_item(random.Random(f"closed-{stream}-{turn}"), words, max_tokens)

    return ClosedLoop(Target(url, api="completions", model=MODEL), clients, make_item)
