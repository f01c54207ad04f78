"""The embedded default on the bundled model: Chinese streams through /infer intact."""

from __future__ import annotations

import json

import pytest

from testbed.coordinator_process import start_coordinator

pytestmark = [pytest.mark.slow, pytest.mark.ray]
PROMPT = "<|im_start|>user\n中国的首都是哪里？<|im_end|>\n<|im_start|>assistant\n"


def test_chinese_streams_whole_characters_through_infer(tmp_path):
    server = start_coordinator(
        tmp_path,
        {
            "digs_scheduler_config": {"deploy_mode": "single_node"},
            "backend_config": {"device": "cpu"},
        },
    )
    try:
        server.wait_ready()
        with server.client() as client:
            response = client.post(
                server.url("predict_port", "/infer"),
                json={
                    "inputs": PROMPT,
                    "stream": True,
                    "parameters": {"max_new_tokens": 24, "details": True},
                },
            )
        events = [json.loads(chunk[6:]) for chunk in response.content[:-2].split(b"\n\n")]
        pieces = [e["token"]["text"] for e in events[:-1]]
        assert all("\ufffd" not in piece for piece in pieces)
        text = events[-1]["generated_text"]
        assert "\ufffd" not in text and sum("\u4e00" <= ch <= "\u9fff" for ch in text) >= 3
        assert len(events) == events[-1]["details"]["generated_tokens"]
    finally:
        assert server.stop() == 0
