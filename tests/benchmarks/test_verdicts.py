"""Two runs' verdicts side by side: the same verdicts pass, one that flips fails."""

from __future__ import annotations

import json

from benchmarks import verdicts


def _run(*ratios: float) -> dict:
    ratio = {"median": sorted(ratios)[len(ratios) // 2], "rounds": list(ratios)}
    return {"_meta": {}, "single_stream": {"ratio": ratio}, "batch32": {"ratio": ratio}}


def test_the_same_verdicts_pass_and_a_flip_fails(tmp_path):
    met = _run(1.31, 1.33, 1.35, 1.30, 1.32)
    again = _run(1.29, 1.34, 1.33, 1.31, 1.36)
    straddles = _run(1.15, 1.25, 1.22, 1.30, 1.19)
    paths = []
    for index, data in enumerate((met, again, straddles)):
        paths.append(tmp_path / f"{index}.json")
        paths[-1].write_text(json.dumps(data))
    assert verdicts.main([str(paths[0]), str(paths[1])]) == 0
    assert verdicts.main([str(paths[0]), str(paths[2])]) == 1
    lines, differ = verdicts.compare(met, straddles)
    assert differ == 1 and any(line.startswith("DIFFER single_stream") for line in lines)
