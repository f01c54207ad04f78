"""The GGUF header reader: every tensor's name, type, shape and bytes as ``gguf.GGUFReader``
gives them, past metadata of every kind (string arrays, nested arrays, an alignment of its
own), the string metadata asked for; a file it does not take is a ``GGUFFormatError``."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from engine.model.gguf_cache import bundled_gguf_path
from engine.model.gguf_index import GGUFFormatError, read_index


def _same_as_the_reference_reader(path) -> None:
    index = read_index(path, ("general.architecture", "general.name", "absent"))
    reference = GGUFReader(str(path))
    assert [t.name for t in index.tensors] == [t.name for t in reference.tensors]
    for ours, theirs in zip(index.tensors, reference.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type, ours.name
        assert ours.shape == tuple(int(n) for n in theirs.shape), ours.name
        expected = np.ascontiguousarray(theirs.data).view(np.uint8)
        assert np.array_equal(ours.data, expected.reshape(ours.data.shape)), ours.name
    field = reference.get_field("general.architecture")
    assert index.strings["general.architecture"] == bytes(field.parts[field.data[0]]).decode()
    assert "absent" not in index.strings


@pytest.mark.parametrize("alignment", [None, 64])
def test_tensors_read_past_metadata_of_every_kind(tmp_path, alignment):
    path = tmp_path / "file.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_name("a model")
    if alignment:
        writer.add_custom_alignment(alignment)
    writer.add_array("tokens", ["a", "bb", "ccc", "\u00e9"] * 50)
    writer.add_array("scores", [0.5] * 33)
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_bool("flag", True)
    writer.add_uint64("big", 1 << 40)
    writer.add_float64("real", 2.5)
    rng = np.random.default_rng(0)
    writer.add_tensor("norm.weight", rng.random(7, dtype=np.float32))
    writer.add_tensor("f16.weight", rng.random((3, 64)).astype(np.float16))
    q8 = rng.integers(0, 255, (4, 2 * 34), dtype=np.uint8)  # 4 rows of two Q8_0 blocks
    writer.add_tensor("q8.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _same_as_the_reference_reader(path)
    index = read_index(path, ("general.name",))
    assert index.strings == {"general.name": "a model"}
    q8_tensor = index.tensors[2]
    assert q8_tensor.shape == (64, 4) and np.array_equal(q8_tensor.data, q8)


def test_a_file_it_does_not_take_is_a_format_error(tmp_path):
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        read_index(not_gguf)
    version_one = tmp_path / "v1.gguf"
    version_one.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(64))
    with pytest.raises(GGUFFormatError, match="version 1"):
        read_index(version_one)
    truncated = tmp_path / "cut.gguf"
    whole = bundled_gguf_path().read_bytes()[:4096]
    truncated.write_bytes(whole)
    with pytest.raises(GGUFFormatError, match="truncated or malformed"):
        read_index(truncated)


@pytest.mark.slow
def test_the_bundled_file_reads_as_the_reference_reader_reads_it():
    _same_as_the_reference_reader(bundled_gguf_path())
