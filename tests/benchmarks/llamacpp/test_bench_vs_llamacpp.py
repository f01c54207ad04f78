"""The llama.cpp side of ``benchmarks/llamacpp/vs_llamacpp.py`` against stand-in tools that print
what ``llama-bench -o json`` and ``llama-batched-bench --output-format jsonl`` print: the
arguments it passes, and the rates it reads back."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from benchmarks.llamacpp import vs_llamacpp
from benchmarks.llamacpp.build import TOOLS, has_tools
from benchmarks.llamacpp.random_gguf import tiny_shape, write_random_gguf
from benchmarks.llamacpp.vs_llamacpp import LlamaCpp, _llama_cpp_folder, compare_best
from engine.kernels import set_activation_dtype

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


def test_every_build_runs_each_round_and_the_faster_is_the_peer():
    calls: list[str] = []
    values = {
        "pdserve": iter([1.0, 20.0, 30.0, 40.0, 50.0, 60.0]),
        "cpu": iter([1.0, 10.0, 10.0, 10.0, 10.0, 10.0]),
        "blas": iter([1.0, 8.0, 12.0, 20.0, 25.0, 30.0]),
    }

    def side(name):
        return lambda: calls.append(name) or next(values[name])

    builds = {"cpu": side("cpu"), "blas": side("blas")}
    result = compare_best(side("pdserve"), builds, rounds=5)
    assert calls[:6] == ["pdserve", "cpu", "blas", "cpu", "blas", "pdserve"]  # rotating
    assert result["llamacpp_build"] == "blas"  # the higher median over the kept rounds
    assert result["ratio"]["rounds"] == [2.5, 2.5, 2.0, 2.0, 2.0]  # each round's own blas rate
    assert result["ratio"]["low"] <= result["ratio"]["median"] <= result["ratio"]["high"]


def test_a_toy_run_writes_a_complete_result(tools, tmp_path, monkeypatch):
    """The whole entry point at toy size: a tiny random GGUF, the stand-in tools, --scratch."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = write_random_gguf(tmp_path / "tiny.gguf", "tiny", tiny_shape("llama"))
    out = tmp_path / "out.json"
    argv = ["--scratch", "--out", str(out), "--llama-cpp-dir", str(tools), "--gguf", str(gguf)]
    argv += ["--rounds", "1", "--new-tokens", "2", "--batch", "2", "--batch-prompt", "4"]
    monkeypatch.setattr("sys.argv", ["vs_llamacpp", *argv, "--prefill-tokens", "8"])
    vs_llamacpp.main()
    result = json.loads(out.read_text())
    assert result["_meta"]["complete"] and result["_meta"]["commit"]
    measures = result["files"][str(gguf)]["measures"]
    assert set(measures) == {"single_stream", "prefill8", "prefill8_cached", "batch2"}
    assert all(
        m["ratio"]["median"] > 0 and len(m["ratio"]["rounds"]) == 1 for m in measures.values()
    )


def test_a_toy_run_on_both_activation_dtypes(tools, tmp_path, monkeypatch):
    """``--activation-dtype both``: int8 and float32 activations as two sides of each round,
    each with its ratio to the peer; ``--measures`` runs only those named."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = write_random_gguf(tmp_path / "tiny.gguf", "tiny", tiny_shape("llama"))
    out = tmp_path / "out.json"
    argv = ["--scratch", "--out", str(out), "--llama-cpp-dir", str(tools), "--gguf", str(gguf)]
    argv += ["--rounds", "1", "--new-tokens", "2", "--batch", "2", "--batch-prompt", "4"]
    argv += ["--activation-dtype", "both", "--measures", "single_stream,batch"]
    monkeypatch.setattr("sys.argv", ["vs_llamacpp", *argv])
    try:
        vs_llamacpp.main()
    finally:
        set_activation_dtype("float32")
    result = json.loads(out.read_text())
    assert result["_meta"]["sides"]["pdserve"]["activation_dtype"] == "int8"
    measures = result["files"][str(gguf)]["measures"]
    assert set(measures) == {"single_stream", "batch2"}
    for measure in measures.values():
        assert len(measure["pdserve_float32"]["rounds"]) == 1
        assert measure["pdserve_float32_ratio"]["median"] > 0 and measure["ratio"]["median"] > 0
