"""Tool calls before the door answers: ``tools``/``tool_choice`` read and refused with the field
named, the prompt with pdserve's Hermes tool prompt or a template's own ``tools``, the history's
calls and results rendered, and the grammar of ``required`` and a named choice: it compiles,
and a tiny model run under it writes a call the parser reads, its arguments valid."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from coordinator.api.errors import OpenAIError
from coordinator.api.tools.grammar import check_constraint, tool_constraint
from coordinator.api.tools.parsers import (
    HermesParser,
    Llama3JsonParser,
    parse_tool_calls,
    select_parser,
)
from coordinator.api.tools.prompt import chat_input, render_tool_chat, renders_tools
from coordinator.api.tools.request import MAX_TOOLS, ToolError, read_tools, tool_chars
from coordinator.model_info import ModelInfo
from engine.constraint import MAX_SPEC_CHARS
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from testbed.tiny_model import build_tiny_tokenizer
from tests.support.door_fakes import WEATHER

TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time"}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# a template that renders tools itself, in the Hermes form
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}{% for c in m.get('tool_calls', []) %}<tool_call>"
    "{{ c['function'] | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _refusal(body: dict) -> ToolError:
    with pytest.raises(ToolError) as caught:
        read_tools(body)
    assert caught.value.status == 400
    return caught.value


# ---- reading the fields ----


def test_tools_and_choices_are_read():
    assert read_tools({}) is None and read_tools({"tools": []}) is None
    auto = read_tools({"tools": TOOLS})
    assert auto is not None and auto.mode == "auto" and auto.parallel
    assert auto.names == {"get_weather", "get_time"}
    assert auto.tools[1].parameters["properties"] == {}  # no parameters: no arguments
    named = read_tools({"tools": TOOLS, "tool_choice": NAMED, "parallel_tool_calls": False})
    assert named is not None and named.mode == "named" and named.name == "get_weather"
    assert [t.name for t in named.forced] == ["get_weather"] and not named.parallel
    none = read_tools({"tools": TOOLS, "tool_choice": "none"})
    assert none is not None and none.offered == () and none.forced == ()


@pytest.mark.parametrize(
    ("body", "param", "shown"),
    [
        ({"tools": "f"}, "tools", '"f"'),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "null"),
        ({"tools": [{"type": "code", "function": {}}]}, "tools[0]", "code"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
            '"a b"',
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
            "tools[0].function.name",
            "xxx",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            "tools[0].function.parameters",
            "[1]",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
            "tools[0].function.strict",
            '"yes"',
        ),
        ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name", "get_weather"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", '"always"'),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            '"nope"',
        ),
        ({"tool_choice": "auto"}, "tool_choice", '"auto"'),
        ({"parallel_tool_calls": True}, "parallel_tool_calls", "true"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", '"no"'),
    ],
)
def test_a_malformed_field_is_400_naming_it(body, param, shown):
    error = _refusal(body)
    assert error.param == param and error.field == param.split(".")[0].split("[")[0]
    assert shown in error.message


def test_bounds_on_count_and_size():
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]
    assert f"at most {MAX_TOOLS}" in _refusal({"tools": many}).message
    huge = {"type": "object", "description": "x" * MAX_SPEC_CHARS}
    big = [{"type": "function", "function": {"name": "f", "parameters": huge}}]
    assert _refusal({"tools": big}).param == "tools[0].function.parameters"
    wide = {"type": "object", "description": "x" * (MAX_SPEC_CHARS // 2)}
    list_over = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": wide}} for i in range(9)
    ]
    assert _refusal({"tools": list_over}).param == "tools"


def test_tool_chars_count_the_tools_and_the_history_calls():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "x" * 50}}
    body = {"tools": TOOLS, "messages": [{"role": "assistant", "tool_calls": [call]}]}
    assert tool_chars(body) == len(json.dumps(TOOLS)) + 51


# ---- the prompt ----


def _history() -> list[dict]:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
    }
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]


def _texts(messages: list[dict]) -> list[str]:
    return [m["content"] or "" for m in messages]


def test_the_fallback_prompt_describes_tools_and_writes_calls_and_results_as_text():
    tokenizer = build_tiny_tokenizer()
    assert not renders_tools(tokenizer)
    tools = read_tools({"tools": TOOLS, "tool_choice": "required"})
    chat = chat_input(tokenizer, _history(), _texts(_history()), tools)
    system, _, assistant, result = chat.messages
    assert chat.tools is None and system["role"] == "system"
    assert system["content"].endswith("Call at least one function.\n\nBe brief.")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in system["content"]
    assert "<tools>" in system["content"] and "<tool_call>" in system["content"]
    call = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}'
    assert assistant == {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"}
    assert result == {"role": "tool", "content": "<tool_response>\nrain\n</tool_response>"}
    prompt = render_tool_chat(tokenizer, chat, with_text=True)
    assert prompt.text is not None and "<tool_response>" in prompt.text and prompt.ids


def test_without_a_system_message_one_is_added_and_none_offers_no_tool():
    tokenizer = build_tiny_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    tools = read_tools({"tools": TOOLS})
    chat = chat_input(tokenizer, messages, ["hi"], tools)
    assert [m["role"] for m in chat.messages] == ["system", "user"]
    none = read_tools({"tools": TOOLS, "tool_choice": "none"})
    assert chat_input(tokenizer, messages, ["hi"], none).messages == messages


def test_a_template_that_refuses_the_tool_role_gets_results_as_user_turns():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool') }}"
        "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    chat = chat_input(tokenizer, _history(), _texts(_history()), None)
    prompt = render_tool_chat(tokenizer, chat, with_text=True)
    assert prompt.text is not None and "user: <tool_response>\nrain" in prompt.text


def test_a_template_with_tools_renders_them_itself():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    assert renders_tools(tokenizer)
    assert select_parser(tokenizer, native=True) is HermesParser
    tools = read_tools({"tools": TOOLS})
    chat = chat_input(tokenizer, _history(), _texts(_history()), tools)
    assert chat.tools == [tool.to_dict() for tool in tools.tools]  # type: ignore[union-attr]
    assert chat.messages[0] == {"role": "system", "content": "Be brief."}
    assert chat.messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo", "days": 1}
    assert chat.messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "rain"}
    text = render_tool_chat(tokenizer, chat, with_text=True).text
    assert text is not None and '<tools>{"type": "function"' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}' in text


def test_llama3_style_templates_get_the_llama3_json_parser():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = "{{ tools }}<|python_tag|>{{ messages }}"
    assert select_parser(tokenizer, native=True) is Llama3JsonParser
    assert select_parser(tokenizer, native=False) is HermesParser


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "rain"}, "messages[0].tool_call_id"),
        ({"role": "assistant", "tool_calls": "f"}, "messages[0].tool_calls"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
            "messages[0].tool_calls[0]",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
            "messages[0].tool_calls[0]",
        ),
    ],
)
def test_malformed_history_is_400_naming_the_message(message, param):
    with pytest.raises(OpenAIError) as caught:
        chat_input(build_tiny_tokenizer(), [message], [""], None)
    assert caught.value.status == 400 and caught.value.param == param


# ---- the grammar ----


@pytest.fixture(scope="module")
def tiny_info() -> ModelInfo:
    tokenizer = build_tiny_tokenizer()
    return ModelInfo("tiny", tokenizer, 1024, len(tokenizer), 1000)


@pytest.mark.parametrize("parser", [HermesParser, Llama3JsonParser])
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_the_grammars_of_required_and_named_compile(tiny_info, parser, choice):
    tools = read_tools({"tools": TOOLS, "tool_choice": choice})
    assert tools is not None
    constraint = tool_constraint(tools, parser)
    assert constraint is not None and constraint.kind == "lark"
    assert tiny_info.grammar_cache().compile(constraint) is not None
    assert tool_constraint(read_tools({"tools": TOOLS}), parser) is None  # type: ignore[arg-type]


def test_a_schema_that_does_not_compile_is_400_naming_its_tool(tiny_info):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}
    tools = read_tools({"tools": [*TOOLS, bad], "tool_choice": "required"})
    assert tools is not None
    with pytest.raises(ToolError) as caught:
        asyncio.run(check_constraint(tiny_info, tool_constraint(tools, HermesParser), tools))
    assert caught.value.param == "tools[2].function.parameters" and caught.value.field == "tools"
    assert "Invalid type: foo" in caught.value.message


@pytest.mark.parametrize(
    ("choice", "parallel", "parser"),
    [
        ("required", True, HermesParser),
        (NAMED, True, HermesParser),
        ("required", False, Llama3JsonParser),
        (NAMED, False, Llama3JsonParser),
    ],
)
def test_a_tiny_model_under_the_grammar_writes_valid_calls(tiny_engine, choice, parallel, parser):
    tools = read_tools({"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel})
    assert tools is not None
    params = SamplingParams(
        max_new_tokens=200,
        do_sample=True,
        temperature=1.5,
        seed=11,
        constraint=tool_constraint(tools, parser),
    )
    tiny_engine.add_request(
        tiny_engine.request("t", tiny_engine.tokenizer.encode("Weather?"), params)
    )
    events = []
    while "t" in tiny_engine.requests:
        events += [e for e in tiny_engine.step() if e.request_id == "t"]
    assert events[-1].finish_reason in (FinishReason.STOP, FinishReason.EOS)
    text = "".join(event.text for event in events)  # what the door reads
    content, calls = parse_tool_calls(parser(tools.names), text)
    assert calls and content == "", text
    if choice == NAMED or not parallel:
        assert len(calls) == 1
    for call in calls:
        if call.name == "get_weather":
            jsonschema.validate(json.loads(call.arguments), WEATHER)
        else:
            assert json.loads(call.arguments) == {}
        assert call.name == "get_weather" or choice == "required"
