"""The key tables of docs/configuration.md, generated from the schema.

    python -m coordinator.config.docs            # rewrite the tables and the chart's values
    python -m coordinator.config.docs --check    # exit 1 when they differ from the schema

Each table sits between ``<!-- config: SECTION -->`` and ``<!-- /config -->`` (SECTION: a
section of ``ms_coordinator.json``, or ``cli`` for the command-line options); everything
outside the markers is prose kept as it is. The same command writes the Helm chart's
``msCoordinator`` values and their JSON schema (:mod:`coordinator.config.chart`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from coordinator.cli import OPTIONS, OVERRIDES
from coordinator.config.chart import render_schema, render_values
from coordinator.config.keys import Key
from coordinator.config.schema import SCHEMA

REPOSITORY = Path(__file__).resolve().parents[2]
DOCS = REPOSITORY / "docs" / "configuration.md"
CHART = REPOSITORY / "deploy" / "helm" / "pdserve"
CHART_FILES = {CHART / "values.yaml": render_values, CHART / "values.schema.json": render_schema}
BLOCK = re.compile(r"(<!-- config: (\S+) -->\n)(.*?)(<!-- /config -->)", re.DOTALL)
KIND_WORDS = {"bool": "bool", "ip": "IP", "list": "list of strings", "dict": "object"}


def _code(value: Any) -> str:
    return f"`{json.dumps(list(value) if isinstance(value, tuple) else value)}`"


def default_text(key: Key) -> str:
    """A key's default as the docs show it."""
    if key.default_by:
        _, defaults = key.default_by
        return ", ".join(f"{_code(value)} in `{choice}`" for choice, value in defaults.items())
    text = _code(key.default)
    if key.feeds and key.feeds.convert and hasattr(key.feeds.default, "describe"):
        text += f" ({key.feeds.default.describe()})"
    return text


def valid_text(key: Key) -> str:
    """A key's valid values as the docs show them."""
    if key.choices:
        return ", ".join(f"`{choice}`" for choice in key.choices)
    if key.low is not None and key.high is not None:
        text = f"[{int(key.low)}, {int(key.high)}]"
        return f"{text} {key.unit}" if key.unit else text
    return KIND_WORDS.get(key.kind, "string")


def section_table(section: str) -> str:
    rows = ["| key | default | valid | meaning |", "|---|---|---|---|"]
    for key in SCHEMA[section].values():
        cells = (f"`{key.name}`", default_text(key), valid_text(key), key.doc)
        if any("|" in cell or "\n" in cell for cell in cells):
            raise ValueError(f"{key.dotted}: a table cell must be one line without '|'")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def cli_table() -> str:
    rows = ["| option | key |", "|---|---|"]
    for option, key in OVERRIDES.items():
        flag = "--" + option.replace("_", "-")
        rows.append(f"| `{flag} {OPTIONS[option][0]}` | `{key}` |")
    return "\n".join(rows) + "\n"


def table(name: str) -> str:
    """The generated block ``name``: a section's keys, or ``cli``."""
    if name == "cli":
        return cli_table()
    if name not in SCHEMA:
        raise ValueError(f"<!-- config: {name} -->: no such section")
    return section_table(name)


def render(text: str) -> str:
    """``text`` with every marked block regenerated."""
    return BLOCK.sub(lambda m: m[1] + table(m[2]) + m[4], text)


def missing(text: str) -> list[str]:
    """The sections (and ``cli``) that have no marked block in ``text``."""
    found = {m[2] for m in BLOCK.finditer(text)}
    return [name for name in (*SCHEMA, "cli") if name not in found]


def check(path: Path) -> list[str]:
    """What is wrong with the tables of ``path``: nothing when they are the schema's."""
    text = path.read_text()
    problems = [f"{path}: no <!-- config: {name} --> block" for name in missing(text)]
    if render(text) != text:
        problems.append(f"{path}: key tables differ from the schema")
    return problems


def check_chart() -> list[str]:
    """What is wrong with the chart's generated values and schema: nothing when current."""
    return [
        f"{path}: differs from the schema"
        for path, render in CHART_FILES.items()
        if render(path.read_text()) != path.read_text()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coordinator.config.docs")
    parser.add_argument("path", nargs="?", type=Path, default=DOCS)
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    args = parser.parse_args(argv)
    if not args.check:
        args.path.write_text(render(args.path.read_text()))
        for path, render_chart in CHART_FILES.items():
            path.write_text(render_chart(path.read_text()))
        return 0
    problems = check(args.path) + check_chart()
    for problem in problems:
        print(f"{problem}; run python -m coordinator.config.docs", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
