"""The prefix-cache benchmark's multi-turn chat workload, the cache hit rate it allows, and the
hit figures of a run.

Every conversation opens with the same system prompt (seeded words cut to a token count). Turn
``k`` sends the system prompt, the user's first ``k`` messages each followed by the answer it
got, then the user's message ``k``: so each turn's prompt extends the previous turn's prompt
plus its answer, and all conversations share the system prompt.

**Allowed hits.** A prefix cache keeps KV in blocks of ``block_size`` tokens, each keyed by the
whole prefix up to its end, so a request can reuse a block only when a request before it
computed exactly that prefix. The cached tokens request ``r`` allows are the full blocks of the
longest prefix of its prompt's token ids that requests sent before ``r`` cover, at most
``(len(prompt) - 1) // block_size`` blocks (the last prompt token is always computed, for its
logits). A request covers its prompt from when it is sent; an engine that also keeps the KV it
decoded covers the prompt plus the answer (``with_answers``) from when the answer has ended.
The allowed hit rate is the sum of allowed cached tokens over the sum of prompt tokens.

It is an upper bound, by send order: it assumes the cache evicts nothing, one engine holds it
(several prefill engines see only what was routed to them), and prompts sent close together are
computed one after the other; an engine that computes them in one batch, or that is still
computing a prefix when the next request wants it, computes that prefix more than once. With
prefill/decode disaggregation only the prefill side's cache serves prompts, and it holds only
prompts it computed: prompts cover, answers do not.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.harness.client import Target, send
from benchmarks.harness.record import RequestRecord
from benchmarks.serving.metrics import percentile
from benchmarks.serving.workload import WORDS, WorkItem, decode_prefix

Encode = Callable[[str], list[int]]


async def take_turn(
    client: httpx.AsyncClient,
    target: Target,
    conversation: Conversation,
    turn: int,
    max_tokens: int,
) -> tuple[RequestRecord, str]:
    """Turn ``turn`` of ``conversation`` as one streamed chat request (``target.api`` chat): its
    record and the answer's text, which the conversation keeps for its next turn. Whatever
    ``send`` raises is the record's error: a failed turn counts, it is never dropped."""
    pieces: list[str] = []

    def on_event(event: dict[str, Any]) -> None:
        for choice in event.get("choices") or []:
            pieces.append((choice.get("delta") or {}).get("content") or "")

    item = WorkItem("", max_tokens, "chat")
    try:
        record = await send(client, target, item, conversation.messages(turn), on_event)
    except Exception as exc:
        record = RequestRecord(0, max_tokens, error=f"{type(exc).__name__}: {exc}"[:300])
    answer = "".join(pieces)
    conversation.add_answer(turn, answer)
    return record, answer


@dataclass
class Conversation:
    """One user's chat: the shared system prompt, its messages, and the answers so far."""

    system: str
    user_messages: list[str]
    answers: list[str] = field(default_factory=list)

    @property
    def num_turns(self) -> int:
        return len(self.user_messages)

    def messages(self, turn: int) -> list[dict[str, str]]:
        """The OpenAI ``messages`` of ``turn`` (0-based); needs the answers of earlier turns."""
        if not 0 <= turn <= len(self.answers) or turn >= self.num_turns:
            raise ValueError(f"turn {turn} needs {turn} answers, has {len(self.answers)}")
        history = [{"role": "system", "content": self.system}]
        for user, answer in zip(self.user_messages[:turn], self.answers, strict=False):
            history += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        return [*history, {"role": "user", "content": self.user_messages[turn]}]

    def add_answer(self, turn: int, answer: str) -> None:
        if turn != len(self.answers):
            raise ValueError(f"answer of turn {turn} given after {len(self.answers)} answers")
        self.answers.append(answer)


def system_prompt(num_tokens: int, encode: Encode | None, seed: int = 0) -> str:
    """Seeded words cut to ``num_tokens`` tokens by ``encode`` (without one, about 1.3 tokens
    a word)."""
    rng = random.Random(f"system-{seed}")
    words = ["Session", f"{seed}.", "You", "are", "a", "helpful", "assistant.", "Notes:"]
    words += [rng.choice(WORDS) for _ in range(num_tokens)]
    if encode is None:
        return " ".join(words[: max(1, int(num_tokens / 1.3))])
    return decode_prefix(" ".join(words), encode, num_tokens)


def make_conversations(
    num_users: int, num_turns: int, system: str, seed: int = 0, user_words: int = 20
) -> list[Conversation]:
    """``num_users`` conversations of ``num_turns`` turns over one ``system`` prompt; each user
    message is ``user_words`` seeded words after a question opener."""
    rng = random.Random(f"users-{seed}")
    conversations = []
    for user in range(num_users):
        messages = [
            f"User {user}, question {turn}: tell me about "
            + " ".join(rng.choice(WORDS) for _ in range(user_words))
            for turn in range(num_turns)
        ]
        conversations.append(Conversation(system, messages))
    return conversations


@dataclass(frozen=True)
class SentPrompt:
    """A request as a prefix cache sees it: its prompt and when it was sent, and its answer and
    when that ended."""

    prompt_ids: tuple[int, ...]
    sent_at: float
    answer_ids: tuple[int, ...] = ()
    ended_at: float = float("inf")


def block_keys(token_ids: Sequence[int], block_size: int, num_blocks: int) -> list[int]:
    """A key per full block of the first ``num_blocks`` blocks, chained over the blocks before
    it (equal keys: equal prefixes)."""
    keys, key = [], 0
    for index in range(min(num_blocks, len(token_ids) // block_size)):
        key = hash((key, tuple(token_ids[index * block_size : (index + 1) * block_size])))
        keys.append(key)
    return keys


def allowed_cached_tokens(
    prompts: Sequence[SentPrompt], block_size: int, with_answers: bool = False
) -> list[int]:
    """Per request (in order), the prompt tokens a prefix cache could have served it (see the
    module docstring): what was covered strictly before it was sent."""
    events = [(p.sent_at, 0, i) for i, p in enumerate(prompts)]  # at a tie, queries first
    events += [(p.sent_at, 1, i) for i, p in enumerate(prompts)]
    if with_answers:
        events += [(p.ended_at, 2, i) for i, p in enumerate(prompts)]
    cached: set[int] = set()
    allowed = [0] * len(prompts)
    for _, kind, index in sorted(events):
        prompt = prompts[index]
        if kind:
            ids = prompt.prompt_ids + (prompt.answer_ids if kind == 2 else ())
            cached.update(block_keys(ids, block_size, len(ids)))
            continue
        most = (len(prompt.prompt_ids) - 1) // block_size
        for key in block_keys(prompt.prompt_ids, block_size, most):
            if key not in cached:
                break
            allowed[index] += block_size
    return allowed


def hit_rate(cached_tokens: Sequence[int | None], prompt_tokens: Sequence[int]) -> float | None:
    """``sum(cached) / sum(prompt)`` over the requests that report a cached count."""
    pairs = [(c, p) for c, p in zip(cached_tokens, prompt_tokens, strict=True) if c is not None]
    total = sum(p for _, p in pairs)
    return sum(c for c, _ in pairs) / total if pairs and total else None


def cache_figures(rows: list[dict], with_answers: bool) -> dict[str, Any]:
    """Hit rates, TTFT quartiles, TTFT and prompt size by turn over the successful requests of
    ``rows`` (a run's requests: ``ok``, ``turn``, ``ttft_s``, ``prompt_tokens`` as the server
    counted them, ``num_prompt_ids`` as rendered here, ``usage_prompt_tokens``,
    ``cached_tokens``, ``allowed_cached_tokens`` and ``allowed_cached_tokens_with_answers``)."""
    done = [r for r in rows if r["ok"]]
    ids = [r["num_prompt_ids"] for r in done]
    allowed = {
        "prompts": hit_rate([r["allowed_cached_tokens"] for r in done], ids),
        "prompts_and_answers": hit_rate(
            [r["allowed_cached_tokens_with_answers"] for r in done], ids
        ),
    }
    ttfts = [r["ttft_s"] for r in done]
    turns = sorted({r["turn"] for r in done})
    return {
        "hit_rate_usage": hit_rate(
            [r["cached_tokens"] for r in done], [r["prompt_tokens"] for r in done]
        ),
        "allowed_hit_rate": allowed["prompts_and_answers" if with_answers else "prompts"],
        "allowed_hit_rates": allowed,
        "ttft_quartiles_s": [percentile(ttfts, 25), percentile(ttfts, 75)],
        "ttft_p50_by_turn_s": [
            percentile([r["ttft_s"] for r in done if r["turn"] == t], 50) for t in turns
        ],
        "prompt_tokens_by_turn": [
            sum(r["prompt_tokens"] for r in done if r["turn"] == t)
            / sum(r["turn"] == t for r in done)
            for t in turns
        ],
        "prompt_token_mismatches": sum(
            r["usage_prompt_tokens"] not in (None, r["num_prompt_ids"]) for r in done
        ),
    }
