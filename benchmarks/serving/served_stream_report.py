"""The served-stream benchmark's figures and goals (``served_stream.py``): each side's rounds
summarized, the goals' per-round ratios judged, and the Markdown the report renders from them.

A side's name says what it measured: ``engine/MODE/N`` (the engine's decode step of N sequences),
``engine_loop/MODE/N`` (N closed-loop streams of the served workload in the engine itself),
``served/MODE/DOOR/N`` (N closed-loop streams through a door of pdserve in MODE) or
``llama_server/N``. A goal's figure is taken within each round from two sides measured in it (or
one absolute figure, the coordinator's CPU per token), and judged by
:func:`benchmarks.harness.stats.judge`: met only when its interval clears the bound.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness.stats import Goal, bootstrap_interval, judge, spread

LLAMA_SERVER = "llama_server"
# goal -> bound: served TPOT p50 at N = 1 / the engine's step at one sequence; the coordinator's
# CPU ms per streamed token at the highest N; served tokens/s at the highest N / the engine's
# rate at that many sequences; the OpenAI door's tokens/s / llama-server's at N; TTFT p50 at
# N = 1 / llama-server's
GOALS: dict[str, Any] = {
    "tpot_over_engine_step": Goal(1.15, at_least=False),
    "coordinator_cpu_ms_per_token": Goal(0.15, at_least=False),
    "rate_over_engine": Goal(0.9),
    "openai_over_llama_server": {1: Goal(1.2), 8: Goal(1.5), 32: Goal(1.3)},
    "ttft_over_llama_server": Goal(1.0, at_least=False),
}
Kept = dict[str, list[dict[str, float]]]


def summarize_sides(kept: Kept) -> dict[str, dict[str, Any]]:
    """Each side's figures: median, bootstrap interval, min, max and rounds."""
    out: dict[str, dict[str, Any]] = {}
    for name, rounds in kept.items():
        if not rounds:
            continue
        keys = sorted({key for one in rounds for key in one})
        out[name] = {key: spread([one.get(key, 0.0) for one in rounds], 4) for key in keys}
    return out


def figure(kept: Kept, side: str, key: str) -> list[float] | None:
    """``key`` of ``side`` in each kept round (None: the side was not measured)."""
    rounds = kept.get(side)
    if not rounds:
        return None
    return [one.get(key, 0.0) for one in rounds]


def ratio(kept: Kept, ours: tuple[str, str], theirs: tuple[str, str]) -> list[float] | None:
    """``ours`` over ``theirs`` ((side, figure) each) round by round."""
    a, b = figure(kept, *ours), figure(kept, *theirs)
    if a is None or b is None:
        return None
    return [x / y if y else float("inf") for x, y in zip(a, b, strict=True)]


def row(
    goal: str, mode: str, door: str, n: int, rounds: list[float] | None, bound: Goal | None
) -> dict[str, Any] | None:
    """One goal's figure over rounds and its verdict (None: a side it needs was not measured)."""
    if rounds is None:
        return None
    verdict = "-" if bound is None else str(judge(rounds, bound))
    unit = " ms" if goal == "coordinator_cpu_ms_per_token" else "x"
    shown = "-" if bound is None else f"{'>=' if bound.at_least else '<='} {bound.value:g}{unit}"
    return {
        "goal": goal, "mode": mode, "door": door, "n": n,
        "bound": shown, "figure": spread(rounds, 4), "verdict": verdict,
    }  # fmt: skip


def engine_rows(kept: Kept, mode: str, doors: list[str], top: int) -> list[dict | None]:
    """Per door: TPOT at N = 1 over the engine's step, the coordinator's CPU per token and the
    rate over the engine's at the highest N; with no goal, the rate over the engine's closed
    loop of the same workload (where it was measured)."""
    rows: list[dict | None] = []
    for door in doors:
        one, many = f"served/{mode}/{door}/1", f"served/{mode}/{door}/{top}"
        tpot = ratio(kept, (one, "tpot_p50_ms"), (f"engine/{mode}/1", "step_ms"))
        cpu = figure(kept, many, "cpu_ms_per_token:coordinator")
        rate = ratio(kept, (many, "tokens_per_s"), (f"engine/{mode}/{top}", "tokens_per_s"))
        rows.append(
            row("tpot_over_engine_step", mode, door, 1, tpot, GOALS["tpot_over_engine_step"])
        )
        rows.append(row("coordinator_cpu_ms_per_token", mode, door, top, cpu,
                        GOALS["coordinator_cpu_ms_per_token"]))  # fmt: skip
        rows.append(row("rate_over_engine", mode, door, top, rate, GOALS["rate_over_engine"]))
        loop = ratio(kept, (many, "tokens_per_s"), (f"engine_loop/{mode}/{top}", "tokens_per_s"))
        rows.append(row("rate_over_engine_loop", mode, door, top, loop, None))
    return rows


def llama_rows(kept: Kept, mode: str, concurrency: list[int]) -> list[dict | None]:
    """The OpenAI door against llama-server: tokens/s at each N, TTFT at N = 1."""
    rows: list[dict | None] = []
    for n in concurrency:
        ours, theirs = f"served/{mode}/openai/{n}", f"{LLAMA_SERVER}/{n}"
        rate = ratio(kept, (ours, "tokens_per_s"), (theirs, "tokens_per_s"))
        goal = GOALS["openai_over_llama_server"].get(n)
        rows.append(row("openai_over_llama_server", mode, "openai", n, rate, goal))
    ttft = ratio(
        kept, (f"served/{mode}/openai/1", "ttft_p50_ms"), (f"{LLAMA_SERVER}/1", "ttft_p50_ms")
    )
    rows.append(
        row("ttft_over_llama_server", mode, "openai", 1, ttft, GOALS["ttft_over_llama_server"])
    )
    return rows


def goal_rows(
    kept: Kept, modes: list[str], doors: list[str], concurrency: list[int]
) -> list[dict[str, Any]]:
    """Every goal's figure and verdict, per mode (and door, and N)."""
    rows: list[dict | None] = []
    for mode in modes:
        rows += engine_rows(kept, mode, doors, max(concurrency))
        rows += llama_rows(kept, mode, concurrency)
    return [one for one in rows if one is not None]


def _cell(spread_: dict[str, Any] | None, digits: int = 1) -> str:
    """Median [min-max] over rounds."""
    if spread_ is None:
        return "-"
    return (
        f"{spread_['median']:.{digits}f} [{spread_['min']:.{digits}f}-{spread_['max']:.{digits}f}]"
    )


def _interval(spread_: dict[str, Any], digits: int = 3) -> str:
    """Median [95 % bootstrap interval] over rounds."""
    low, high = bootstrap_interval(spread_["rounds"])
    return f"{spread_['median']:.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"


SIDE_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("tokens/s", "tokens_per_s", 1),
    ("TTFT p50 ms", "ttft_p50_ms", 0),
    ("first requests' TTFT p50 ms", "burst_ttft_p50_ms", 0),
    ("TPOT p50 ms", "tpot_p50_ms", 1),
    ("tokens an answer", "tokens_per_request", 0),
    ("coordinator CPU ms/token", "cpu_ms_per_token:coordinator", 3),
    ("workers CPU ms/token", "cpu_ms_per_token:workers", 3),
    ("Ray daemons CPU ms/token", "cpu_ms_per_token:ray_daemons", 3),
    ("all CPU ms/token", "cpu_ms_per_token:all", 3),
)


def side_table(sides: dict[str, dict[str, Any]]) -> list[str]:
    """A row per side: the engine's step (its ms in the TPOT column), every served stream and
    llama-server (its own process in the coordinator's CPU column)."""
    lines = [
        "| side | " + " | ".join(title for title, _, _ in SIDE_COLUMNS) + " | failed |",
        "|---" * (len(SIDE_COLUMNS) + 2) + "|",
    ]
    for name, figures in sides.items():
        shown = dict(figures)
        if "step_ms" in shown:
            shown["tpot_p50_ms"] = shown["step_ms"]
        if name.startswith(LLAMA_SERVER):
            shown["cpu_ms_per_token:coordinator"] = shown.get(f"cpu_ms_per_token:{LLAMA_SERVER}")
        cells = [_cell(shown.get(key), digits) for _, key, digits in SIDE_COLUMNS]
        failed = int(sum(figures.get("failed", {}).get("rounds", [])))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {failed} |")
    return lines


def goal_table(goals: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| goal | mode | door | N | median [95 % interval] | bound | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for one in goals:
        lines.append(
            f"| {one['goal']} | {one['mode']} | {one['door']} | {one['n']} | "
            f"**{_interval(one['figure'])}** | {one['bound']} | {one['verdict']} |"
        )
    return lines


HEADLINE_NAMES = {
    "tpot_over_engine_step": "served TPOT p50 / the engine's step",
    "coordinator_cpu_ms_per_token": "coordinator CPU ms per token",
    "rate_over_engine": "served tokens/s / the engine's rate",
    "rate_over_engine_loop": "served tokens/s / the engine's closed loop (no goal)",
    "openai_over_llama_server": "tokens/s / llama-server's",
    "ttft_over_llama_server": "TTFT p50 / llama-server's",
}


def render_headline(data: dict[str, Any], header: str = "") -> str:
    """The OpenAI door's verdicts, a row per goal and a column per mode (the README's front
    page; every door's are in the full table)."""
    goals = [one for one in data.get("goals", []) if one["door"] == "openai"]
    modes = list(dict.fromkeys(one["mode"] for one in goals))
    rows: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for one in goals:
        rows.setdefault((one["goal"], one["n"]), {})[one["mode"]] = one
    lines = [
        f"| goal, `/v1/completions` | N | bound | {' | '.join(f'`{m}`' for m in modes)} |",
        "|---|---|---|" + "---|" * len(modes),
    ]
    for (goal, n), by_mode in rows.items():
        bound = next(iter(by_mode.values()))["bound"]
        cells = [_verdict_cell(by_mode[m]) if m in by_mode else "-" for m in modes]
        lines.append(f"| {HEADLINE_NAMES.get(goal, goal)} | {n} | {bound} | {' | '.join(cells)} |")
    return "\n".join([*([header, ""] if header else []), *lines])


def _verdict_cell(goal: dict[str, Any]) -> str:
    """``1.44 [1.36-1.55] missed``: the median, its interval and the verdict's first word."""
    return f"{_interval(goal['figure'])} {goal['verdict'].split(' ', 1)[0]}"


def render(data: dict[str, Any], header: str = "") -> str:
    """The result file as Markdown: ``header`` (the run's provenance), the sides' table and the
    goals' verdicts."""
    settings = data.get("settings", {})
    meta = data.get("_meta", {})
    intro = (
        f"{meta.get('rounds', '?')} kept rounds ({meta.get('dropped_rounds', '?')} dropped), "
        f"~{settings.get('prompt_tokens', '?')}-token prompts, {settings.get('new_tokens', '?')} "
        f"tokens an answer, counted over {settings.get('window_s', '?')} s after "
        f"{settings.get('lead_s', '?')} s of load; median [min-max] over rounds. Engine rows: "
        "the decode step's ms (TPOT column) and N / step."
    )
    lines = [*([header, ""] if header else []), intro, "", *side_table(data["sides"]), ""]
    return "\n".join([*lines, *goal_table(data.get("goals", []))])
