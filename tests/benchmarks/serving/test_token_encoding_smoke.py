"""``benchmarks.serving.token_encoding`` at toy size: every step size and codec measured, each
with a positive cost and frame size, msgpack's frame the smaller."""

from __future__ import annotations

from benchmarks.serving.token_encoding import CODECS, STEP_SIZES, run


def test_token_encoding_toy_run():
    result = run(repeat=3, rounds=1)
    assert set(result) == {f"{count}_events" for count in STEP_SIZES}
    for row in result.values():
        assert set(row) == set(CODECS)
        assert all(f["us_per_event"] > 0 and f["bytes_per_event"] > 0 for f in row.values())
        assert row["msgpack"]["bytes_per_event"] < row["pickle"]["bytes_per_event"]
