"""Tests that need something from the machine (a binary, a data directory, a toolchain) ask for it
here. Locally a missing prerequisite skips the test with a reason naming what is missing; in CI
(``CI=true``, as ``.ci/run`` sets) it fails the test, since CI provides every prerequisite and a
skip there would hide a regression."""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require(condition: object, missing: str) -> None:
    """Return when ``condition`` holds; otherwise skip (locally) or fail (in CI), saying that
    ``missing`` is missing."""
    __tracebackhide__ = True  # skips and failures point at the test that asked
    if condition:
        return
    if in_ci():
        pytest.fail(f"CI lacks a prerequisite: {missing}", pytrace=False)
    pytest.skip(f"missing {missing}")
