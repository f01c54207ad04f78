"""The toy size the KV hand-off benchmarks' smoke tests run at, and what they check of a plane."""

from __future__ import annotations

SIZES = ("8", "32")


def toy_argv(model, out) -> list[str]:
    sizes = ",".join(SIZES)
    return ["--out", str(out), "--model", str(model), "--block-size", "4", "--sizes", sizes,
            "--rounds", "2", "--transfers", "2", "--threads", "1"]  # fmt: skip


def assert_measured(figures: dict, name: str) -> None:
    """One plane's figures at one size: numbers, no error."""
    assert "error" not in figures, (name, figures)
    mb_s = figures["mb_s"]
    assert len(mb_s["rounds"]) == 2 and all(v > 0 for v in mb_s["rounds"]), (name, mb_s)
    assert mb_s["low"] <= mb_s["median"] <= mb_s["high"], (name, mb_s)
    assert figures["share_of_prefill"] > 0, name
