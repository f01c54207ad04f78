"""The performance tables of the README and docs/performance against the committed result
files they are generated from: each block renders exactly from its JSON, a table edited by hand
(or a JSON re-run without regenerating) is caught, and every result file says which machine,
code and command made it."""

from __future__ import annotations

import json

import pytest

from benchmarks import report
from benchmarks.serving.draws import HELD_OUT_SEEDS

FILES = (
    "vs_llamacpp",
    "vs_llamacpp_rerun",
    "vs_llamacpp_1b",
    "vs_llamacpp_int8",
    "vs_llamacpp_sizes",
    "vs_llamacpp_3b",
    "engine",
    "compare_modes",
    "decode_step",
    "avx2_paths",
    "int8_rows",
    "accuracy",
    "kv_dtype",
    "speculation",
    "served_speculation",
    "multi_turn",
    "planner_shifting_mix",
    "prompt_dtype",
    "decode_limit",
    "soak",
    "replicas",
    "http_edge",
    "structured",
    "memory",
    "memory_1b",
    "memory_1b_kv16",
    "served_stream",
    "door_framing",
    "door_costs",
    "logprobs_cost",
    "served_stream_event_loop",
    "prompt_steps",
    "burst",
    "burst_short_timeout",
)
BLOCKS = {
    *FILES,
    "vs_llamacpp:headline",
    "served_stream:headline",
}  # the headline view in the README, the rest in docs/
PROVENANCE = ("cpu", "isa_executes", "cpuid_flags", "commit", "date", "command")


def test_every_block_is_what_its_json_renders():
    names = set()
    for document in report.DOCUMENTS:
        text = document.read_text()
        names |= {m.group(2) for m in report.BLOCK.finditer(text)}
        assert report.stale_blocks(text) == [], document
    assert names == BLOCKS
    assert report.main(["--check"]) == 0


def test_a_figure_edited_by_hand_is_caught(tmp_path):
    readme = (report.ROOT / "docs" / "performance" / "engine.md").read_text()
    block = next(m for m in report.BLOCK.finditer(readme) if m.group(2) == "vs_llamacpp")
    row = next(line for line in block.group(3).splitlines() if "| prefill512 |" in line)
    edited = readme.replace(row, row.replace("**", "**9", 1))
    assert report.stale_blocks(edited) == ["vs_llamacpp"]
    copy = tmp_path / "engine.md"
    copy.write_text(edited)
    assert report.main(["--check", "--document", str(copy)]) == 1
    assert report.main(["--document", str(copy)]) == 0  # regenerated ...
    assert copy.read_text() == readme  # ... to the committed text


def test_every_result_file_is_rendered_somewhere():
    rendered = {m.group(2) for d in report.DOCUMENTS for m in report.BLOCK.finditer(d.read_text())}
    files = {path.stem for path in report.RESULTS.glob("*.json")}
    assert files <= set(report.RENDERERS), files - set(report.RENDERERS)
    assert files == {report.result_file(name) for name in rendered}


@pytest.mark.parametrize("name", FILES)
def test_each_result_file_records_its_machine_code_and_command(name):
    data = json.loads((report.RESULTS / f"{name}.json").read_text())
    meta = data.get("_meta") or data.get("meta") or data
    assert all(meta.get(key) for key in PROVENANCE), {k: meta.get(k) for k in PROVENANCE}
    commands = ("python -m benchmarks.", "python benchmarks/", "python -m tests.soak.run")
    assert meta["command"].startswith(commands)


def test_the_engine_figures_computed_their_prompts():
    engine = json.loads((report.RESULTS / "engine.json").read_text())
    vs_llamacpp = json.loads((report.RESULTS / "vs_llamacpp.json").read_text())
    measures = [("engine", key, entry) for key, entry in report._measures(engine)]
    measures += report.vs_llamacpp_measures(vs_llamacpp)
    for name, measure, entry in measures:
        if not measure.endswith("_cached"):
            assert entry["prefix_cache_hit_tokens"] == 0, (name, measure)


def _spread(median: float) -> dict:
    return {"median": median, "min": median, "max": median, "rounds": [median]}


def test_a_several_file_result_renders_a_row_per_file_and_measure():
    measure = {"pdserve": _spread(30.0), "llamacpp": _spread(20.0), "ratio": _spread(1.5)}
    measure |= {"llamacpp_build": "cpu", "prefix_cache_hit_tokens": 0}
    file = {"gguf": "m.Q4_K_M.gguf", "size_bytes": 2**20, "tensor_types": {"Q4_K": 3, "F32": 2}}
    data = {
        "_meta": {"cpu": "c", "sides": {"llamacpp_cpu": {"cmake_options": ["-DGGML_AVX2=ON"]}}},
        "files": {
            "bundled": {"file": file, "measures": {"single_stream": measure}},
            "1b-q4_k_m": {"file": file, "measures": {"single_stream": measure, "batch8": measure}},
        },
    }
    text = report.render_vs_llamacpp(data)
    assert "| 1b-q4_k_m | batch8 | 30.0 [30.0-30.0] | 20.0 [20.0-20.0] (cpu) |" in text
    assert text.count("| single_stream |") == 2 and "goal" in text
    assert "- 1b-q4_k_m: `m.Q4_K_M.gguf` (1 MiB; tensors 3 Q4_K, 2 F32)" in text
    assert [name for name, _, _ in report.vs_llamacpp_measures(data)] == [
        "bundled",
        *["1b-q4_k_m"] * 2,
    ]


def test_a_serving_result_says_when_its_seeds_are_not_held_out():
    name = "compare_modes"
    data = json.loads((report.RESULTS / f"{name}.json").read_text())
    assert len(data["seeds"]) >= 3
    rendered = report.RENDERERS[name](data)
    held_out = set(data["seeds"]) <= set(HELD_OUT_SEEDS)
    assert ("are tuning seeds now" in rendered) != held_out


def test_the_replicas_figures_name_their_draws_and_free_every_block():
    data = json.loads((report.RESULTS / "replicas.json").read_text())
    assert len(data["seeds"]) >= 3
    for side in ("one", "two"):
        rows = data["short_completions"][side]["rates"]
        assert all(len(row["ttft_p99_s_per_draw"]) == len(data["seeds"]) for row in rows)
    assert all(run["blocks_in_use_after"] == 0 for run in data["kill"]["runs"])


def test_a_prose_figure_in_a_performance_document_is_caught():
    text = "<!-- report: engine -->\n1.5x\n<!-- /report -->\nThe step is 2.1x faster now.\n"
    assert report.prose_figures(text) == ["The step is 2.1x faster now."]
    assert report.prose_figures("A header is capped at 8 MiB; a probe every 50 ms.") == []


def test_a_goal_is_met_only_when_the_intervals_lower_end_clears_it():
    # the median clears 1.2, one round does not: undecided, not met
    straddling = {"median": 1.25, "min": 1.19, "max": 1.30, "rounds": [1.19, 1.25, 1.3, 1.24, 1.27]}
    assert report._goal(straddling, 1.2).startswith(">= 1.2x: undecided (met in 4 of 5 rounds")
    clear = {"median": 1.3, "min": 1.28, "max": 1.33, "rounds": [1.28, 1.3, 1.33, 1.31, 1.29]}
    assert report._goal(clear, 1.2) == ">= 1.2x: met (met in 5 of 5 rounds)"
    short = {"median": 1.01, "min": 0.99, "max": 1.04, "rounds": [0.99, 1.04]}
    assert "undecided" in report._goal(short, 1.2) and "2 rounds kept" in report._goal(short, 1.2)
    assert report._goal(1.5, 1.2) == ">= 1.2x: undecided (a single figure, no rounds)"
    assert report._goal(clear, 1.4, at_least=False).startswith("<= 1.4x: met")


def test_goals_are_the_files_own():
    assert report.engine_goal(None, "batch32") == report.engine_goal("bundled-q8_0", "batch32") == 2
    assert report.engine_goal("1b-q4_k_m", "single_stream") == 1.1  # the sizes people serve
    assert report.engine_goal("0.5b-q4_k_m", "batch32") == 1.5
    assert report.engine_goal("3b-q4_k_m", "single_stream") == 1.0
    assert report.engine_goal("3b-q4_k_m", "prefill512") is None  # no goal named
