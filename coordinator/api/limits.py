"""The limits on what a client controls, in one place (``docs/api.md`` lists them).

Each is checked as soon as the request is read, before it costs memory or time; an over-limit
request is answered 422 in the door's error shape, with a message naming the parameter, its limit
and the value received (:func:`over_limit`). The body itself is bounded while it is read
(``request_limit.body_limit``, 413; :func:`~coordinator.api.common.read_body`).
"""

from __future__ import annotations

from collections.abc import Sized

MAX_STOP_SEQUENCES = 4  # stop strings of one request (OpenAI, Azure, TGI, MLflow)
MAX_STOP_CHARS = 256  # characters of one stop string
MAX_MESSAGES = 2048  # chat messages of one request (OpenAI, Azure, MLflow chat)
MAX_EMBEDDING_INPUTS = 2048  # texts of one embeddings request
MAX_INVOCATION_ROWS = 64  # rows of one /invocations request (and never more than max_requests)
MAX_INPUT_CHARS = 4 * 1024 * 1024  # characters of a MindIE or tokenizer input
MAX_INPUT_TOKENS = 1024 * 1024  # tokens of any prompt, whatever the model allows


def over_limit(name: str, what: str, limit: int, received: int) -> str:
    """The message of an over-limit refusal, e.g. ``stop may hold at most 4 strings, but got
    10000``."""
    return f"{name} may hold at most {limit} {what}, but got {received}"


def count_over(name: str, what: str, value: Sized, limit: int) -> str | None:
    """:func:`over_limit`'s message when ``value`` holds more than ``limit`` items, else None."""
    return over_limit(name, what, limit, len(value)) if len(value) > limit else None


def stop_limit_message(name: str, stop: list) -> str | None:
    """Why a list of stop strings is over the limits (count, then each string's length), or
    None when it is within them. Strings longer than the limit are reported by index."""
    message = count_over(name, "stop sequences", stop, MAX_STOP_SEQUENCES)
    if message:
        return message
    for index, text in enumerate(stop):
        if isinstance(text, str) and len(text) > MAX_STOP_CHARS:
            return over_limit(f"{name}[{index}]", "characters", MAX_STOP_CHARS, len(text))
    return None
