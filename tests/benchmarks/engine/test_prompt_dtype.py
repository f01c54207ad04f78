"""``python -m benchmarks.engine.prompt_dtype``: its timing waits for every prompt's first token
and frees every request, and a toy run on a random GGUF writes and renders bfloat16 against
float32."""

from __future__ import annotations

import json

from benchmarks import report
from benchmarks.engine import prompt_dtype
from benchmarks.llamacpp.random_gguf import tiny_shape, write_random_gguf
from tests.conftest import make_engine
from tests.support.block_checks import num_used


def test_a_burst_is_timed_to_every_first_token_and_freed_after(tiny_loaded):
    engine = make_engine(tiny_loaded)
    seconds = prompt_dtype.prompt_seconds(engine, [[5] * 40, [6] * 3, [7] * 70])
    assert seconds > 0 and not engine.has_work() and num_used(engine.blocks) == 0


def test_a_toy_run_writes_bfloat16_against_float32(tmp_path):
    gguf = write_random_gguf(tmp_path / "tiny.gguf", "tiny", tiny_shape("llama"))
    out = tmp_path / "prompt_dtype.json"
    prompt_dtype.main(["--scratch", "--out", str(out), "--gguf", str(gguf), "--case", "2:40",
                       "--case", "1:64", "--rounds", "2"])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["_meta"]["complete"]
    entry = result["files"][str(gguf)]
    assert list(entry["cases"]) == ["2:40", "1:64"] and "prompts in bfloat16" in entry["engine"]
    for figures in entry["cases"].values():
        assert set(figures["ms"]) == set(prompt_dtype.SIDES)
        assert len(figures["bfloat16_speedup"]["rounds"]) == 2
        assert figures["bfloat16_speedup"]["verdict"] == "undecided"  # 2 rounds decide nothing
    table = report.RENDERERS["prompt_dtype"](result)
    assert f"| {gguf} | 1:64 |" in table and table.count("undecided") == 2
