"""The llama.cpp side of ``benchmarks/llamacpp/vs_llamacpp.py`` against stand-in tools that print
what ``llama-bench -o json`` and ``llama-batched-bench --output-format jsonl`` print: the
arguments it passes, and the rates it reads back."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from benchmarks.llamacpp.build import TOOLS, has_tools
from benchmarks.llamacpp.vs_llamacpp import LlamaCpp, _llama_cpp_folder, compare

BENCH_ROW = {"build_commit": "abc1234", "build_number": 7, "cpu_info": "test cpu", "avg_ts": 151.5}
BATCHED_ROW = {"pp": 64, "tg": 128, "pl": 32, "t": 20.0, "speed": 300.0, "speed_tg": 250.0}


def _tool(folder: Path, name: str, output: str) -> None:
    """A stand-in that records its arguments next to itself and prints ``output``."""
    script = folder / name
    script.write_text(
        f'#!/bin/sh\necho "$@" > "{folder}/{name}.args"\ncat <<\'EOF\'\n{output}\nEOF\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def tools(tmp_path) -> Path:
    _tool(tmp_path, "llama-bench", json.dumps([BENCH_ROW]))
    batched = "main: n_kv_max = 8192\n" + json.dumps(BATCHED_ROW)
    _tool(tmp_path, "llama-batched-bench", batched)
    return tmp_path


def test_rates_and_arguments(tools):
    llama = LlamaCpp(tools, Path("/models/m.gguf"), threads=2)
    assert llama.bench(512, 0) == 151.5
    args = (tools / "llama-bench.args").read_text().split()
    assert args == [
        "-m",
        "/models/m.gguf",
        "-t",
        "2",
        "-p",
        "512",
        "-n",
        "0",
        "-r",
        "1",
        "-o",
        "json",
    ]
    assert llama.build == {"build_commit": "abc1234", "build_number": 7, "cpu_info": "test cpu"}
    # new tokens over the whole run, prefill included: 32 * 128 / 20 s
    assert llama.batched(32, 64, 128) == pytest.approx(204.8)
    args = (tools / "llama-batched-bench.args").read_text().split()
    assert args[args.index("-npl") + 1] == "32" and args[args.index("-ntg") + 1] == "128"
    assert int(args[args.index("-c") + 1]) >= 32 * (64 + 128)


def test_a_failing_tool_is_an_error_naming_it(tmp_path):
    script = tmp_path / "llama-bench"
    script.write_text("#!/bin/sh\necho 'failed to load model' >&2\nexit 1\n")
    script.chmod(0o755)
    with pytest.raises(RuntimeError, match="failed to load model"):
        LlamaCpp(tmp_path, Path("m.gguf"), 2).bench(0, 128)


def test_a_given_folder_must_hold_both_tools(tools, tmp_path_factory):
    assert has_tools(tools) and _llama_cpp_folder(tools) == tools
    empty = tmp_path_factory.mktemp("empty")
    assert not has_tools(empty)
    with pytest.raises(SystemExit, match=" and ".join(TOOLS)):
        _llama_cpp_folder(empty)


def test_rounds_alternate_and_the_first_is_dropped():
    calls: list[str] = []
    ours = iter([1.0, 10.0, 20.0, 30.0])
    theirs = iter([1.0, 5.0, 10.0, 10.0])

    def side(name, values):
        return lambda: calls.append(name) or next(values)

    result = compare(side("ours", ours), side("theirs", theirs), rounds=4)
    assert calls == ["ours", "theirs", "theirs", "ours", "ours", "theirs", "theirs", "ours"]
    assert result["ratio"]["rounds"] == [2.0, 2.0, 3.0]
    assert result["ratio"]["median"] == 2.0
