"""docs/configuration.md's key tables are the schema's: ``python -m coordinator.config.docs``
writes them, and this fails when the committed file says anything else."""

from __future__ import annotations

import subprocess
import sys

import yaml

from coordinator.config.chart import CHART_DEFAULTS, CHART_SETS, chart_keys, render_values
from coordinator.config.docs import (
    CHART,
    DOCS,
    check,
    check_chart,
    default_text,
    main,
    render,
    valid_text,
)
from coordinator.config.schema import KEYS, SCHEMA


def test_the_committed_tables_are_the_schemas():
    assert check(DOCS) == [], "run: python -m coordinator.config.docs"


def test_every_key_is_in_the_docs_with_its_default_and_range():
    text = DOCS.read_text()
    for key in KEYS:
        row = f"| `{key.name}` | {default_text(key)} | {valid_text(key)} | {key.doc} |"
        assert row in text, key.dotted


def test_a_stale_table_fails_the_check_and_is_rewritten(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    text = DOCS.read_text()
    stale.write_text(text.replace("| `maxSeqLen` | `2560` |", "| `maxSeqLen` | `4096` |"))
    assert main(["--check", str(stale)]) == 1
    assert "differ from the schema" in capsys.readouterr().err
    assert main([str(stale)]) == 0
    assert stale.read_text() == text
    assert main(["--check", str(stale)]) == 0


def test_a_section_without_its_block_fails_the_check(tmp_path):
    start, end = "<!-- config: log_info -->\n", "<!-- /config -->"
    text = DOCS.read_text()
    block = text[text.index(start) : text.index(end, text.index(start)) + len(end)]
    missing = tmp_path / "configuration.md"
    missing.write_text(text.replace(block, ""))
    assert check(missing) == [f"{missing}: no <!-- config: log_info --> block"]


def test_prose_outside_the_markers_is_kept():
    text = "intro\n<!-- config: log_info -->\nold\n<!-- /config -->\noutro\n"
    rendered = render(text)
    assert rendered.startswith("intro\n<!-- config: log_info -->\n| key |")
    assert rendered.endswith("<!-- /config -->\noutro\n") and "old" not in rendered
    assert "`log_level`" in rendered and set(SCHEMA["log_info"]) == {"log_level"}


def test_the_command_checks_the_committed_docs():
    result = subprocess.run(
        [sys.executable, "-m", "coordinator.config.docs", "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_the_charts_values_and_schema_are_the_schemas():
    assert check_chart() == [], "run: python -m coordinator.config.docs"


def test_the_chart_lists_every_key_it_does_not_manage_with_pdserves_default():
    values = yaml.safe_load((CHART / "values.yaml").read_text())["msCoordinator"]
    for section, keys in chart_keys().items():
        for key in keys:
            if key.dotted in CHART_SETS or key.default_by:
                assert key.name not in values[section], key.dotted  # the chart decides it
                continue
            expected = CHART_DEFAULTS.get(key.dotted, key.default)
            listed = values[section][key.name]
            assert listed == (list(expected) if isinstance(expected, tuple) else expected)
    assert "tls_config" not in values and "api_keys" not in values["http_config"]


def test_a_stale_chart_fails_the_check(tmp_path, monkeypatch):
    stale = tmp_path / "values.yaml"
    text = (CHART / "values.yaml").read_text()
    stale.write_text(text.replace("maxSeqLen: 2560", "maxSeqLen: 4096"))
    files = {stale: render_values}
    monkeypatch.setattr("coordinator.config.docs.CHART_FILES", files)
    assert check_chart() == [f"{stale}: differs from the schema"]
    assert main([]) == 0 and stale.read_text() == text
