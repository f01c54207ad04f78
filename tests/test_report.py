"""The performance tables of the README and docs/performance against the committed result
files they are generated from: each block renders exactly from its JSON, a table edited by hand
(or a JSON re-run without regenerating) is caught, and every result file says which machine,
code and command made it."""

from __future__ import annotations

import json

import pytest

from benchmarks import report

NAMES = ("vs_llamacpp", "engine", "compare_modes", "decode_step")  # the README's
NAMES_IN_DOCS = ("core_sharing", "http_edge", "structured", "memory")
PROVENANCE = ("cpu", "isa_executes", "cpuid_flags", "commit", "date", "command")


def test_every_block_is_what_its_json_renders():
    names = set()
    for document in report.DOCUMENTS:
        text = document.read_text()
        names |= {m.group(2) for m in report.BLOCK.finditer(text)}
        assert report.stale_blocks(text) == [], document
    assert names == {*NAMES, *NAMES_IN_DOCS}
    assert report.main(["--check"]) == 0


def test_a_figure_edited_by_hand_is_caught(tmp_path):
    readme = report.README.read_text()
    block = next(m for m in report.BLOCK.finditer(readme) if m.group(2) == "vs_llamacpp")
    row = next(line for line in block.group(3).splitlines() if line.startswith("| prefill512 |"))
    edited = readme.replace(row, row.replace("**", "**9", 1))
    assert report.stale_blocks(edited) == ["vs_llamacpp"]
    copy = tmp_path / "README.md"
    copy.write_text(edited)
    assert report.main(["--check", "--document", str(copy)]) == 1
    assert report.main(["--document", str(copy)]) == 0  # regenerated ...
    assert copy.read_text() == readme  # ... to the committed text


@pytest.mark.parametrize("name", [*NAMES, *NAMES_IN_DOCS])
def test_each_result_file_records_its_machine_code_and_command(name):
    data = json.loads((report.RESULTS / f"{name}.json").read_text())
    meta = data.get("_meta") or data.get("meta") or data
    assert all(meta.get(key) for key in PROVENANCE), {k: meta.get(k) for k in PROVENANCE}
    assert meta["command"].startswith("python benchmarks/")


def test_the_engine_figures_computed_their_prompts():
    for name in ("vs_llamacpp", "engine"):
        data = json.loads((report.RESULTS / f"{name}.json").read_text())
        for measure, entry in data.items():
            if not measure.startswith("_") and not measure.endswith("_cached"):
                assert entry["prefix_cache_hit_tokens"] == 0, (name, measure)


def test_the_serving_headline_comes_from_held_out_draws():
    data = json.loads((report.RESULTS / "compare_modes.json").read_text())
    assert data["draw_set"] == "held-out" and len(data["seeds"]) >= 3
    assert all(result["draws"] == len(data["seeds"]) for result in data["results"].values())


def test_core_sharing_was_decided_on_held_out_draws():
    data = json.loads((report.RESULTS / "core_sharing.json").read_text())
    assert data["draw_set"] == "held-out" and len(data["seeds"]) >= 3
    for with_mode, without_mode in report.CORE_SHARING_PARTS.values():
        assert {with_mode, without_mode} <= set(data["results"])
