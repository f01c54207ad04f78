"""Prompt integrity on every chat door (OpenAI, Azure, MLflow ``llm/v1/chat``): a ``role`` outside
system/user/assistant/tool is 400 naming it; text spelling a control token in a message is
tokenized as text (the template's own control tokens stay real, a plain prompt's ids are
unchanged); the content filter reads the rendered chat; and MindIE's and TGI's answers pass the
output filter. The predict app runs in process over a recording service and the tiny model's real
(byte-level BPE) tokenizer; no Ray, no model."""

from __future__ import annotations

import json

import pytest
import text_generation

from coordinator.api.chat_prompt import ROLES, SHOWN_CHARS
from testbed.tiny_model import SPECIAL_TOKENS, build_tiny_tokenizer
from tests.support.door_fakes import events, post, serving
from tests.support.recording_service import (
    CHAT_DOORS,
    CONTROL_IDS,
    CUT,
    FRAMING_FILTER,
    INJECTION,
    PIECES,
    ROGUE_ROLE,
    TOKENIZER,
    WEAPONS,
    RecordingService,
    TemplateOnlyTokenizer,
    _filtered,
    app_for,
    message_of,
    template_ids,
)


@pytest.mark.parametrize("path", CHAT_DOORS)
@pytest.mark.parametrize("role", [ROGUE_ROLE, "developer", 7, None])
def test_a_role_outside_the_four_is_400_naming_it(path, role):
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": "obey"}]
    service = RecordingService()
    response = post(app_for(service), path, {"messages": messages})
    assert response.status_code == 400, response.text
    message = message_of(response.json())
    assert message.startswith(f"'messages[1].role' must be one of {', '.join(ROLES)}, got ")
    shown = message.split(", got ", 1)[1]
    assert len(shown) <= SHOWN_CHARS + 3 and json.dumps(role)[:SHOWN_CHARS] in shown
    if path == "/v1/chat/completions":
        assert response.json()["error"]["param"] == "messages[1].role"
    assert service.prompts == []  # nothing was generated


@pytest.mark.parametrize("path", CHAT_DOORS)
def test_each_of_the_four_roles_is_taken(path):
    answers = {"tool": {"tool_call_id": "call_1"}}  # a tool result names the call it answers
    messages = [{"role": r, "content": f"a {r} turn", **answers.get(r, {})} for r in ROLES]
    response = post(app_for(RecordingService()), path, {"messages": messages})
    assert response.status_code == 200, response.text


def test_a_conversation_the_template_refuses_is_400_not_500():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('system turns are not supported') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    messages = [{"role": "system", "content": "42"}]
    response = post(
        app_for(RecordingService(), tokenizer), "/v1/chat/completions", {"messages": messages}
    )
    assert response.status_code == 400, response.text
    assert "system turns are not supported" in message_of(response.json())


@pytest.mark.parametrize("path", CHAT_DOORS)
def test_control_token_text_in_a_message_is_tokenized_as_text(path):
    service = RecordingService()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": INJECTION}]
    response = post(app_for(service), path, {"messages": messages})
    assert response.status_code == 200, response.text
    (ids,) = service.prompts
    # exactly the control tokens the template writes for two turns and the generation prompt
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    template_controls = [i for i in template_ids(plain) if i in CONTROL_IDS]
    assert [i for i in ids if i in CONTROL_IDS] == template_controls
    # and the injected text is all there, as text
    rendered = TOKENIZER.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert TOKENIZER.decode(list(ids)) == rendered
    unsafe = template_ids(messages)  # what the template alone would have made of it
    assert sum(i in CONTROL_IDS for i in unsafe) == len(template_controls) + 4


@pytest.mark.parametrize("path", CHAT_DOORS)
def test_a_plain_prompt_keeps_exactly_its_ids(path):
    service = RecordingService()
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "The quick brown fox\n\njumps <b>over</b> 你好 |im_start|"},
        {"role": "assistant", "content": "Yes."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "then?"}],
        },
    ]
    response = post(app_for(service), path, {"messages": messages})
    assert response.status_code == 200, response.text
    flat = [*messages[:3], {"role": "user", "content": "and then?"}]
    assert list(service.prompts[0]) == template_ids(flat)


def test_without_sanitizing_control_token_text_is_refused():
    service = RecordingService()
    app = app_for(service, TemplateOnlyTokenizer())
    bad = [{"role": "user", "content": "fine"}, {"role": "user", "content": INJECTION}]
    response = post(app, "/v1/chat/completions", {"messages": bad})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[1].content"
    assert "a control token of this model" in error["message"]
    assert any(token in error["message"] for token in SPECIAL_TOKENS)
    fine = post(app, "/v1/chat/completions", {"messages": bad[:1]})
    assert fine.status_code == 200 and service.prompts == [tuple(template_ids(bad[:1]))]


@pytest.mark.parametrize("path", CHAT_DOORS)
def test_the_input_filter_reads_the_rendered_chat(path):
    service = RecordingService()
    app = app_for(service, content_filter=FRAMING_FILTER)
    blocked = post(app, path, {"messages": [{"role": "user", "content": "sudo rm -rf /"}]})
    assert blocked.status_code == 400, blocked.text
    assert "filtered" in message_of(blocked.json())
    assert service.prompts == []
    allowed = post(app, path, {"messages": [{"role": "user", "content": "please, sudo"}]})
    assert allowed.status_code == 200, allowed.text


def test_infer_whole_answer_is_cut_at_a_match():
    response, service = _filtered("/infer", {"inputs": "hi", "parameters": {"details": True}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["generated_text"] == CUT
    assert body["details"]["finish_reason"] == "content_filter"
    assert service.taken == [3]  # the generation stopped at the match


def test_infer_stream_never_sends_the_match():
    response, service = _filtered("/infer", {"inputs": "hi", "stream": True})
    payloads = [json.loads(e[6:]) for e in events(response)]
    sent = "".join(p["token"]["text"] or "" for p in payloads)
    assert "shoot" not in sent and "today" not in sent
    assert payloads[-1]["generated_text"] == CUT
    assert service.taken == [3]


@pytest.mark.parametrize("path", ["/generate", "/"])
def test_tgi_whole_answer_is_cut_at_a_match(path):
    response, service = _filtered(path, {"inputs": "hi"})
    assert response.status_code == 200, response.text
    body = response.json()
    answer = body[0] if path == "/" else body
    assert answer["generated_text"] == CUT
    assert answer["details"]["finish_reason"] == "stop_sequence"
    assert "".join(t["text"] for t in answer["details"]["tokens"]) == CUT
    assert service.taken == [3]


@pytest.mark.parametrize(("path", "body"), [("/generate_stream", {}), ("/", {"stream": True})])
def test_tgi_stream_never_sends_the_match(path, body):
    response, service = _filtered(path, {"inputs": "hi", **body})
    payloads = [json.loads(e[5:]) for e in events(response)]
    sent = "".join(p["token"]["text"] for p in payloads)
    assert "shoot" not in sent and sent.startswith(CUT[:-3])
    assert payloads[-1]["generated_text"] == CUT
    assert payloads[-1]["details"]["finish_reason"] == "stop_sequence"
    assert service.taken == [3]


@pytest.mark.parametrize("path", ["/infer", "/generate"])
def test_an_answer_the_filter_does_not_match_is_whole(path):
    service = RecordingService(("a fine", " answer"))
    response = post(app_for(service, content_filter=WEAPONS), path, {"inputs": "hi"})
    assert response.json()["generated_text"] == "a fine answer"


def test_the_text_generation_client_reads_a_filtered_answer():
    """TGI's own client parses the cut answer, whole and streamed (it knows no other finish)."""
    service = RecordingService(PIECES)
    with serving(app_for(service, content_filter=WEAPONS)) as url:
        client = text_generation.Client(url)
        whole = client.generate("hi")
        streamed = list(client.generate_stream("hi"))
    assert whole.generated_text == CUT
    assert whole.details.finish_reason == text_generation.types.FinishReason.StopSequence
    assert streamed[-1].generated_text == CUT
