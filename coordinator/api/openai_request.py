"""What OpenAI-style requests ask for, validated: the sampling settings pdserve honours, the
prompt as token ids (chat messages through the model's chat template, their roles checked:
:mod:`~coordinator.api.chat_prompt`), and whether the content filter blocks the input (for chat:
the messages' text and the rendered chat). The Azure chat route and MLflow's scorer read their
requests the same way. Every refusal is an :class:`~coordinator.api.openai_format.OpenAIError`
naming the field.

``stop`` (a string or a list of up to :data:`~coordinator.api.limits.MAX_STOP_SEQUENCES`) ends
generation on an exact match in the decoded text and is cut from the answer. Over-limit lists
(stop strings, messages) are 422.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from coordinator.api.chat_prompt import check_roles
from coordinator.api.clients import UNLIMITED, Client
from coordinator.api.errors import FormatError, OpenAIError
from coordinator.api.limits import (
    MAX_MESSAGES,
    MAX_STOP_SEQUENCES,
    count_over,
    prompt_chars_message,
    stop_limit_message,
)
from coordinator.api.structured_request import check_compiles, constraint_param, request_constraint
from coordinator.api.tools.prompt import chat_input, render_tool_chat
from coordinator.api.tools.request import ToolRequest, tool_chars
from coordinator.content_safety import text_blocked
from coordinator.model_info import ModelInfo
from engine.constraint import Constraint
from engine.sampling_params import MAX_LOGIT_BIAS, MAX_SEED, MAX_TOP_LOGPROBS, SamplingParams

MAX_COMPLETION_LOGPROBS = 5  # the completions API's bound on ``logprobs``


def _number(body: dict, name: str, low: float, high: float, integer: bool, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, int if integer else int | float) and not isinstance(value, bool)
    if not ok or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        bounds = f"[{int(low)}, {int(high)}]" if integer else f"[{low:g}, {high:g}]"
        raise OpenAIError(
            400, f"'{name}' must be {kind} in {bounds}, got {json.dumps(value)}", name
        )
    return value


def _flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise OpenAIError(400, f"'{name}' must be true or false, got {json.dumps(value)}", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        return ()
    if isinstance(stop, list) and (over := stop_limit_message("stop", stop)):
        raise OpenAIError(422, over, "stop")
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise OpenAIError(
            400,
            f"'stop' must be a string or a list of up to {MAX_STOP_SEQUENCES} non-empty strings",
            "stop",
        )
    return tuple(stop)


def openai_sampling(body: dict, vocab_size: int, default_max_tokens: int) -> SamplingParams:
    """The OpenAI parameters pdserve honours, validated."""
    if body.get("n") not in (None, 1):
        raise OpenAIError(400, f"'n' must be 1, got {json.dumps(body['n'])}", "n")
    stop = _stop(body)
    max_tokens = {"max_tokens": body.get("max_completion_tokens", body.get("max_tokens"))}
    temperature = _number(body, "temperature", 0, 2, False, 1.0)
    presence = _number(body, "presence_penalty", -2, 2, False, 0.0)
    frequency = _number(body, "frequency_penalty", -2, 2, False, 0.0)
    top_p = _number(body, "top_p", 0, 1, False, 1.0)
    seed = _number(body, "seed", 0, MAX_SEED, True, None)
    return SamplingParams(
        max_new_tokens=_number(max_tokens, "max_tokens", 1, 2**31 - 1, True, default_max_tokens),
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else 1.0,
        top_p=top_p if top_p > 0 else 1e-9,
        top_k=min(_number(body, "top_k", 0, 2**31 - 1, True, 0), vocab_size),
        repetition_penalty=_number(body, "repetition_penalty", 1e-6, 100, False, 1.0),
        seed=seed if seed is not None else secrets.randbelow(MAX_SEED) + 1,
        stop=stop,
        ignore_eos=_flag(body, "ignore_eos"),
        speculative=_flag(body, "speculative", True),
        presence_penalty=presence,
        frequency_penalty=frequency,
        logit_bias=_logit_bias(body.get("logit_bias"), vocab_size),
    )


def openai_logprobs(body: dict, kind: str) -> int:
    """The alternatives a token's log probabilities list (``SamplingParams.logprobs``; -1: none
    asked): chat's ``logprobs`` (true or false) and ``top_logprobs`` (0 to 20, only with
    ``logprobs: true``); completions' ``logprobs`` (0 to 5, null: none)."""
    if kind != "chat":
        value = _number(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS, True, None)
        return -1 if value is None else value
    asked = _flag(body, "logprobs") if body.get("logprobs") is not None else False
    top = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, True, None)
    if top is not None and not asked:
        message = f"'top_logprobs' needs 'logprobs': true, got top_logprobs {top}"
        raise OpenAIError(400, message, "top_logprobs")
    return (top or 0) if asked else -1


def _logit_bias(value: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``{"<token id>": bias}`` with ids in [0, vocab) and biases in [-100, 100], at most
    :data:`~engine.sampling_params.MAX_LOGIT_BIAS` entries; 400 naming ``logit_bias``."""
    if value is None:
        return ()
    valid = (
        f"an object of at most {MAX_LOGIT_BIAS} token ids (strings of integers in "
        f"[0, {vocab_size - 1}]) to biases in [-100, 100]"
    )
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        got = f"{len(value)} entries" if isinstance(value, dict) else json.dumps(value)[:64]
        raise OpenAIError(400, f"'logit_bias' must be {valid}, got {got}", "logit_bias")
    pairs = []
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else -1
        number = isinstance(bias, int | float) and not isinstance(bias, bool)
        if not 0 <= token < vocab_size or not number or not -100 <= bias <= 100:
            shown = json.dumps({key: bias})[:64]
            raise OpenAIError(400, f"'logit_bias' must be {valid}, got {shown}", "logit_bias")
        pairs.append((token, float(bias)))
    return tuple(pairs)


async def openai_constraint(
    body: dict, model: ModelInfo, client: Client = UNLIMITED
) -> Constraint | None:
    """What the output must match (``response_format`` or vLLM's structured-output fields,
    :mod:`~coordinator.api.structured_request`), compiled once here (a new spec charged to
    ``client``): 400 naming the field when it is malformed or does not compile."""
    try:
        constraint = request_constraint(body)
        await check_compiles(model, constraint, constraint_param(body), client)
    except FormatError as exc:
        raise OpenAIError(400, exc.message, exc.param) from exc
    return constraint


def prompt_field(kind: str) -> str:
    """The body field that holds the prompt: ``messages`` for chat, else ``prompt``."""
    return "messages" if kind == "chat" else "prompt"


@dataclass(frozen=True)
class Prompt:
    """A request's prompt: its token ids, and the text the content filter reads (the prompt;
    for chat the messages' text and the chat as the template rendered it)."""

    ids: list[int]
    text: str


async def read_prompt(
    body: dict, kind: str, model: ModelInfo, tools: ToolRequest | None = None
) -> Prompt:
    """The prompt: chat ``messages`` through the chat template
    (:mod:`~coordinator.api.chat_prompt`; with the ``tools`` offered and the history's tool
    calls and results: :mod:`~coordinator.api.tools.prompt`), or ``prompt``; refused before
    tokenizing when its messages are too many or its text is over the character cap."""
    messages = body.get("messages") if kind == "chat" else None
    if isinstance(messages, list) and (
        over := count_over("messages", "messages", messages, MAX_MESSAGES)
    ):
        raise OpenAIError(422, over, "messages")
    over = prompt_chars_message(
        prompt_field(kind), prompt_chars(body, kind), model.max_input_tokens
    )
    if over:
        raise OpenAIError(422, over, prompt_field(kind))
    prompt = await (
        _chat_prompt(body, model, tools) if kind == "chat" else _text_prompt(body, model)
    )
    if not 0 < len(prompt.ids) <= model.max_input_tokens:
        raise OpenAIError(
            400,
            f"the prompt has {len(prompt.ids)} tokens; this model takes at most "
            f"{model.max_input_tokens}",
            prompt_field(kind),
        )
    return prompt


async def _chat_prompt(body: dict, model: ModelInfo, tools: ToolRequest | None) -> Prompt:
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) for m in messages)
    ):
        raise OpenAIError(400, "'messages' must be a non-empty list of {role, content}", "messages")
    check_roles(messages)
    _check_text_parts(messages)
    texts = [content_text(m.get("content")) for m in messages]
    rendered = chat_input(model.tokenizer, messages, texts, tools)
    filtering = model.content_filter is not None
    chat = await run_in_threadpool(render_tool_chat, model.tokenizer, rendered, filtering)
    raw = rendered.text
    return Prompt(chat.ids, f"{raw}\n{chat.text}" if filtering else raw)


def _check_text_parts(messages: list[dict]) -> None:
    """400 naming the first text part of a message's content whose ``text`` is not a string."""
    for index, message in enumerate(messages):
        content = message.get("content")
        for part_index, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") == "text":
                text = part.get("text", "")
                if not isinstance(text, str):
                    name = f"messages[{index}].content[{part_index}].text"
                    got = json.dumps(text)[:200]
                    raise OpenAIError(400, f"'{name}' must be a string, got {got}", "messages")


async def _text_prompt(body: dict, model: ModelInfo) -> Prompt:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise OpenAIError(400, "'prompt' must be a non-empty string", "prompt")
    return Prompt(await run_in_threadpool(model.tokenizer.encode, prompt), prompt)


def prompt_chars(body: dict, kind: str) -> int:
    """The characters of a request's prompt text (messages' or ``prompt``'s), whatever its
    shape (what is not text counts nothing here: it is refused later)."""
    if kind != "chat":
        prompt = body.get("prompt")
        texts = prompt if isinstance(prompt, list) else [prompt]
        return sum(len(text) for text in texts if isinstance(text, str))
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    chars = sum(_content_chars(m.get("content")) for m in messages if isinstance(m, dict))
    return chars + tool_chars(body)


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    parts = content if isinstance(content, list) else []
    texts = (part.get("text") for part in parts if isinstance(part, dict))
    return sum(len(text) for text in texts if isinstance(text, str))


def content_text(content: Any) -> str:
    """A message's text: the string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    return ""


def input_blocked(model: ModelInfo, prompt: Prompt) -> bool:
    """Whether the content filter blocks the prompt's text (for chat, the rendered chat too)."""
    return text_blocked(model.content_filter, prompt.text)
