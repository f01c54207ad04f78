"""Every field OpenAI's chat and completions APIs define, and what the OpenAI door does with
it: honoured, accepted as what it is (an identifier that changes no output), or refused with
400 naming it when a value asks for what pdserve does not do. No field is silently ignored: a
body key that neither API defines nor pdserve extends it with is 400, as OpenAI answers it
(``Unrecognized request argument supplied``). ``docs/api.md`` has the table.
"""

from __future__ import annotations

import json
from typing import Any

from coordinator.api.errors import OpenAIError

# read by openai_request / structured_request / the tool-call modules
HONOURED = frozenset(
    {
        "model",  # accepted: the one served model answers, whatever the name
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "stream",
        "stream_options",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "response_format",
        "logprobs",  # chat: true or false; completions: 0 to 5 alternatives
    }
)
CHAT_ONLY = frozenset({"messages", "tools", "tool_choice", "parallel_tool_calls", "top_logprobs"})
COMPLETIONS_ONLY = frozenset({"prompt"})
# identifiers and hints that change no output: accepted as they are
IDENTIFIERS = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key"})
# pdserve's extensions (vLLM's names where vLLM has one)
EXTENSIONS = frozenset(
    {
        "top_k",
        "repetition_penalty",
        "ignore_eos",
        "speculative",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    }
)
# defined fields pdserve does not do: each accepted only at a value meaning "off"; why not
OFF_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "store": ((None, False), "completions are not stored"),
    "service_tier": ((None, "auto", "default"), "there is one service tier (auto)"),
    "modalities": ((None, ["text"]), "the model writes text only"),
    "audio": ((None,), "the model writes text only"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "there is no web search"),
    "reasoning_effort": ((None,), "the model does not reason apart from its answer"),
    "verbosity": ((None,), "the model has no verbosity setting"),
    "functions": ((None, []), "use 'tools' (functions is the deprecated form)"),
    "function_call": ((None, "none"), "use 'tool_choice' (function_call is the deprecated form)"),
    "best_of": ((None, 1), "only one candidate is generated (best_of 1)"),
    "echo": ((None, False), "the prompt is not echoed"),
    "suffix": ((None, ""), "insertion after a suffix is not supported"),
}


def check_fields(body: dict, kind: str) -> None:
    """400 naming the first field of ``body`` that the OpenAI API of ``kind`` (``chat`` or
    ``text``) does not define, or whose value asks for what pdserve does not do."""
    own = CHAT_ONLY if kind == "chat" else COMPLETIONS_ONLY
    for name, value in body.items():
        if name in HONOURED or name in own or name in IDENTIFIERS or name in EXTENSIONS:
            continue
        if name in OFF_VALUES:
            offs, why_not = OFF_VALUES[name]
            if not any(_same(value, off) for off in offs):
                shown = json.dumps(value)[:64]
                raise OpenAIError(400, f"'{name}' is not supported: {why_not}; got {shown}", name)
            continue
        raise OpenAIError(400, f"Unrecognized request argument supplied: {name[:64]}", name[:64])
    _check_stream_options(body.get("stream_options"))
    _check_identifiers(body)


def _same(value: Any, off: Any) -> bool:
    return type(value) is type(off) and value == off


def _check_stream_options(options: Any) -> None:
    if options is None:
        return
    known = {"include_usage", "include_obfuscation"}
    if not isinstance(options, dict) or not set(options) <= known:
        raise OpenAIError(
            400,
            "'stream_options' must be an object with include_usage and include_obfuscation "
            f"(booleans), got {json.dumps(options)[:64]}",
            "stream_options",
        )
    for name, value in options.items():
        if not isinstance(value, bool):
            message = f"'stream_options.{name}' must be true or false, got {json.dumps(value)[:64]}"
            raise OpenAIError(400, message, f"stream_options.{name}")


def _check_identifiers(body: dict) -> None:
    """Identifiers are bounded like OpenAI's: strings of at most 512 characters (``user``, ...),
    ``metadata`` up to 16 string pairs."""
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        value = body.get(name)
        if value is not None and (not isinstance(value, str) or len(value) > 512):
            message = f"'{name}' must be a string of at most 512 characters"
            raise OpenAIError(400, message, name)
    metadata = body.get("metadata")
    if metadata is None:
        return
    ok = isinstance(metadata, dict) and len(metadata) <= 16
    if not ok or not all(
        isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
        for k, v in metadata.items()
    ):
        raise OpenAIError(
            400,
            "'metadata' must be at most 16 pairs of strings (keys of at most 64 characters, "
            "values of at most 512)",
            "metadata",
        )
