"""``benchmarks/llamacpp/requantize.py`` and the file sets of ``benchmarks/llamacpp/gguf_sets.py``
without llama.cpp: the ``llama-quantize`` command line, the cached name, a file already made being
reused, and the tensor types counted from a file."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from benchmarks.llamacpp.gguf_sets import NAMED_SETS, is_named, resolve_gguf
from benchmarks.llamacpp.random_gguf import tiny_shape, write_random_gguf
from benchmarks.llamacpp.requantize import (
    quantize_command,
    requantized_name,
    requantized_path,
    tensor_type_counts,
)


def test_the_command_line_requantizes_into_the_target():
    command = quantize_command(
        Path("/t/llama-quantize"), Path("a.gguf"), Path("b.gguf"), "q4_k_m", 2
    )
    assert command == ["/t/llama-quantize", "--allow-requantize", "a.gguf", "b.gguf", "Q4_K_M", "2"]


def test_the_copy_is_named_by_its_type():
    assert requantized_name(Path("/x/SmolLM2.Q4_1.gguf"), "q8_0") == "SmolLM2.Q8_0.gguf"
    assert requantized_name(Path("random-1b-f16.gguf"), "Q4_K_M") == "random-1b.Q4_K_M.gguf"
    assert requantized_name(Path("plain.gguf"), "Q6_K") == "plain.Q6_K.gguf"


def test_a_stand_in_tool_writes_the_copy_once(tmp_path):
    tool = tmp_path / "llama-quantize"
    tool.write_text('#!/bin/sh\necho "$@" >> "$0.calls"\ncp "$2" "$3"\n')
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    source = tmp_path / "m.Q4_1.gguf"
    source.write_bytes(b"GGUF")
    made = requantized_path(source, "Q5_K_M", tmp_path / "out", tools=tmp_path, threads=1)
    again = requantized_path(source, "Q5_K_M", tmp_path / "out", tools=tmp_path, threads=1)
    assert made == again == tmp_path / "out" / "m.Q5_K_M.gguf" and made.read_bytes() == b"GGUF"
    assert len((tmp_path / "llama-quantize.calls").read_text().splitlines()) == 1


def test_a_failing_tool_says_why(tmp_path):
    tool = tmp_path / "llama-quantize"
    tool.write_text("#!/bin/sh\necho 'invalid file type' >&2\nexit 1\n")
    tool.chmod(0o755)
    with pytest.raises(RuntimeError, match="invalid file type"):
        requantized_path(tmp_path / "m.gguf", "Q4_K_M", tmp_path / "out", tools=tmp_path)


def test_tensor_types_are_counted(tmp_path):
    path = write_random_gguf(tmp_path / "t.gguf", "tiny", tiny_shape("qwen2"))
    # per layer 7 F16 matrices; F32: 2 norms and 3 biases per layer, the output norm
    assert tensor_type_counts(path) == {"F16": 1 + 2 * 7, "F32": 2 * 5 + 1}


def test_set_names_and_paths(tmp_path):
    assert all(is_named(name) for name in NAMED_SETS) and not is_named("model.gguf")
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    assert resolve_gguf(str(path)) == path
    with pytest.raises(ValueError, match="neither a set"):
        resolve_gguf(str(tmp_path / "absent.gguf"))
