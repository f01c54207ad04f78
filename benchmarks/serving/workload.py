"""Workloads for the serving benchmark: a JSONL dataset, or a synthetic mix made on the fly.

One line per request: ``{"prompt": str, "output_tokens": int, "kind": str, "prompt_tokens": int}``
(``prompt_tokens`` as counted by the tokenizer the mix was made with; optional in user files).
The synthetic kinds are short chat, long-prompt summarisation and long generation; a mix is a
list of ``kind=weight``.

A sweep over rates serves one draw's request *shapes* (kind, prompt and output lengths, in one
order) at every rate, each rate with text of its own (:func:`rate_workloads`): the rates differ
in their arrivals only, and no rate finds another's prompts in a prefix cache.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from pathlib import Path

# name: (prompt tokens, output tokens)
KINDS = {"chat": (64, 64), "summarise": (1000, 32), "generate": (32, 192)}
DEFAULT_MIX = "chat=0.6,summarise=0.2,generate=0.2"
_SENTENCE = (
    "the cache keeps keys and values in blocks while a scheduler batches prompts and decodes "
    "tokens for many requests at once across prefill and decode workers that share pages over "
    "sockets river mountain city garden library winter summer engine signal paper music story "
    "quiet bright early late north south market harbour bridge window forest island"
)
WORDS = _SENTENCE.split()


@dataclass(frozen=True)
class WorkItem:
    prompt: str
    output_tokens: int
    kind: str = "custom"
    prompt_tokens: int = 0


def parse_mix(text: str, kinds: Collection[str] = tuple(KINDS)) -> dict[str, float]:
    """``kind=weight,...`` with every kind one of ``kinds``."""
    mix = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        if name not in kinds or not weight:
            raise ValueError(f"mix entries are kind=weight with kind in {sorted(kinds)}: {part!r}")
        mix[name] = float(weight)
    return mix


def synthetic(
    num: int, mix: dict[str, float], count_tokens: Callable[[str], list[int]] | None, seed: int = 0
) -> list[WorkItem]:
    """``num`` requests drawn from ``mix``; prompts are cut to their token length with
    ``count_tokens`` (a tokenizer's encode), else sized at about 1.3 tokens per word."""
    rng = random.Random(seed)
    kinds = rng.choices(list(mix), weights=list(mix.values()), k=num)
    return [_item(kind, rng, count_tokens) for kind in kinds]


def _item(kind: str, rng: random.Random, encode: Callable[[str], list[int]] | None) -> WorkItem:
    prompt_tokens, output_tokens = KINDS[kind]
    words = [rng.choice(WORDS) for _ in range(prompt_tokens)]
    if kind == "summarise":
        words = ["Summarise", "this", "text:", *words]
    text = " ".join(words)
    if encode is None:
        text = " ".join(words[: max(1, int(prompt_tokens / 1.3))])
        return WorkItem(text, output_tokens, kind, prompt_tokens)
    cut = decode_prefix(text, encode, prompt_tokens)
    return WorkItem(cut, output_tokens, kind, len(encode(cut)))


@dataclass(frozen=True)
class Shape:
    """What a request asks of a server, without its text."""

    kind: str
    prompt_tokens: int
    output_tokens: int


def draw_shapes(num: int, mix: dict[str, float], seed: int) -> list[Shape]:
    """``num`` request shapes drawn from ``mix`` (``seed``'s)."""
    rng = random.Random(f"shapes-{seed}")
    kinds = rng.choices(list(mix), weights=list(mix.values()), k=num)
    return [Shape(kind, *KINDS[kind]) for kind in kinds]


def realize(
    shapes: list[Shape], encode: Callable[[str], list[int]] | None, text_seed: str
) -> list[WorkItem]:
    """A request of each shape, in order, with text of ``text_seed``'s: prompts of exactly the
    shape's token count when a filler word fits (``encode``), else about 1.3 tokens a word."""
    rng = random.Random(f"text-{text_seed}")
    return [_sized(shape, rng, encode) for shape in shapes]


def rate_workloads(
    num: int,
    mix: dict[str, float],
    encode: Callable[[str], list[int]] | None,
    seed: int,
    rates: int,
) -> list[list[WorkItem]]:
    """The requests of each of ``rates`` rates of draw ``seed``: the same shapes in the same
    order at every rate, the text each rate's own."""
    shapes = draw_shapes(num, mix, seed)
    return [realize(shapes, encode, f"{seed}-rate-{index}") for index in range(rates)]


def shapes_of(items: list[WorkItem]) -> list[tuple[str, int, int]]:
    """(kind, prompt tokens, output tokens) of each request."""
    return [(item.kind, item.prompt_tokens, item.output_tokens) for item in items]


def offered_load(items: list[WorkItem], rate: float | None) -> dict[str, float | None]:
    """The prompt and output tokens per second ``items`` offer at ``rate`` req/s (None: all at
    once, no rate): the shapes' sums times the rate over their count."""
    if not items or rate is None or rate == float("inf"):
        return {"prompt_tokens_per_s": None, "output_tokens_per_s": None}
    scale = rate / len(items)
    return {
        "prompt_tokens_per_s": round(sum(i.prompt_tokens for i in items) * scale, 2),
        "output_tokens_per_s": round(sum(i.output_tokens for i in items) * scale, 2),
    }


def _sized(shape: Shape, rng: random.Random, encode: Callable[[str], list[int]] | None) -> WorkItem:
    words = [rng.choice(WORDS) for _ in range(shape.prompt_tokens)]
    if shape.kind == "summarise":
        words = ["Summarise", "this", "text:", *words]
    if encode is None:
        text = " ".join(words[: max(1, int(shape.prompt_tokens / 1.3))])
        return WorkItem(text, shape.output_tokens, shape.kind, shape.prompt_tokens)
    text = decode_prefix(" ".join(words), encode, shape.prompt_tokens)
    count = len(encode(text))
    fillers = rng.sample(WORDS, len(WORDS))
    while count < shape.prompt_tokens:  # one more word of one token, while one fits
        for word in fillers:
            longer = len(encode(f"{text} {word}"))
            if longer == count + 1:
                text, count = f"{text} {word}", longer
                break
        else:
            break
    return WorkItem(text, shape.output_tokens, shape.kind, count)


def decode_prefix(text: str, encode: Callable[[str], list[int]], num_tokens: int) -> str:
    """The longest word-boundary prefix of ``text`` with at most ``num_tokens`` tokens."""
    words = text.split(" ")
    low, high = 1, len(words)
    while low < high:
        mid = (low + high + 1) // 2
        if len(encode(" ".join(words[:mid]))) <= num_tokens:
            low = mid
        else:
            high = mid - 1
    return " ".join(words[:low])


def load_dataset(path: str | Path) -> list[WorkItem]:
    items = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("output_tokens"), int):
            raise ValueError(f"{path}:{number}: needs a string prompt and an int output_tokens")
        items.append(
            WorkItem(
                row["prompt"],
                row["output_tokens"],
                row.get("kind", "custom"),
                row.get("prompt_tokens", 0),
            )
        )
    return items


def write_dataset(items: list[WorkItem], path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(asdict(item)) + "\n" for item in items))
