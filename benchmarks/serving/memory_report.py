"""The tables of ``docs/performance/memory.md`` from ``benchmarks/results/memory.json``
(``bench_memory.py``): each side's whole process tree, and each mode's processes by role, with
the figures of the run before the cuts beside them when the file holds one (``before``)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

SIDES = ("single_node", "pd_separate", "llama_server")
# the whole tree's PSS against llama-server's, at most, per side
TREE_GOALS = {"single_node": 1.5, "pd_separate": 1.5}


def by_role(side: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``role -> {"count", "rss_mib", "pss_mib", "uss_mib"}`` summed over its processes."""
    roles: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for process in side.get("processes", []):
        role = roles[process["role"]]
        role["count"] += 1
        for kind in ("rss_mib", "pss_mib", "uss_mib"):
            role[kind] += process[kind]
    return roles


def kv_mib(name: str, side: dict[str, Any], meta: dict[str, Any]) -> float:
    """The KV budget the side was given: every engine's (pd_separate: decode plus prefill)."""
    given = side.get("given", {})
    if name == "llama_server":
        return meta["llama_server_kv_mib"]
    budget = given["kvCacheMemoryMB"]
    if name == "pd_separate":
        return budget + (given.get("prefill_kv_cache_memory_mb") or budget)
    return budget


def tree_table(data: dict[str, Any], goals: dict[str, float]) -> list[str]:
    """Each side's whole tree against its goal; with the PSS of the run before (``before``)
    when there is one."""
    before = data.get("before")
    peer = data.get("llama_server", {}).get("total", {}).get("pss_mib")
    was_column = ["PSS before"] if before else []
    header = [
        "side", "processes", "RSS MiB", "PSS MiB", "USS MiB", *was_column,
        "PSS / llama-server's", "goal", "its KV budget", "PSS less KV",
    ]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in SIDES:
        side = data.get(name)
        if side is None:
            continue
        if "missing" in side:
            lines.append(f"| {name} | not measured: {side['missing']} |" + " |" * (len(header) - 2))
            continue
        total = side["total"]
        ratio = total["pss_mib"] / peer if peer else None
        goal = goals.get(name)  # none for the peer itself
        verdict = "-" if ratio is None or goal is None else "met" if ratio <= goal else "missed"
        goal_cell = "-" if goal is None else f"<= {goal:g}x: {verdict}"
        was = (before or {}).get(name, {}).get("total", {}).get("pss_mib")
        was_cell = [f"{'-' if was is None else f'{was:.0f}'}"] if before else []
        kv = kv_mib(name, side, data["_meta"])
        cells = [
            name, str(len(side["processes"])), f"{total['rss_mib']:.0f}",
            f"**{total['pss_mib']:.0f}**", f"{total['uss_mib']:.0f}", *was_cell,
            "-" if ratio is None else f"{ratio:.2f}x", goal_cell, f"{kv:.0f}",
            f"{total['pss_mib'] - kv:.0f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def roles_table(name: str, side: dict[str, Any], before: dict[str, Any] | None) -> list[str]:
    """``side``'s processes by role; beside the run before's when there is one."""
    now, was = by_role(side), by_role(before or {})
    extra = " PSS before | PSS saved |" if before is not None else ""
    lines = [
        f"{name}, by role (MiB; a role with several processes is their sum):",
        "",
        "| role | processes | RSS | PSS | USS |" + extra,
        "|---|---|---|---|---|" + ("---|---|" if extra else ""),
    ]
    order = sorted({*now, *was}, key=lambda r: -max(now.get(r, {}).get("pss_mib", 0),
                                                   was.get(r, {}).get("pss_mib", 0)))  # fmt: skip
    for role in order:
        here, there = now.get(role), was.get(role)
        pss = here["pss_mib"] if here else 0.0
        cells = (
            f"{here['count']:.0f} | {here['rss_mib']:.0f} | {pss:.0f} | {here['uss_mib']:.0f}"
            if here
            else "0 | - | - | -"
        )
        row = f"| {role} | {cells} |"
        if extra:
            saved = f"{there['pss_mib'] - pss:.0f}" if there else "-"
            row += f" {there['pss_mib']:.0f} | {saved} |" if there else " - | - |"
        lines.append(row)
    return lines


def _mib(value: float | None) -> str:
    return "no GGUF" if value is None else f"{value:.0f} MiB"


def render(data: dict[str, Any], provenance: str, goals: dict[str, float] = TREE_GOALS) -> str:
    meta, before = data["_meta"], data.get("before")
    lines = [
        provenance,
        "",
        f"{meta['slots']} sequences x {meta['context']} tokens of context on the same GGUF "
        f"({_mib(meta.get('gguf_mib'))}); each pdserve engine's KV budget {meta['kv_mib']} MiB "
        f"({meta.get('kv_cache_dtype', 'float32')}), llama-server's KV "
        f"{meta['llama_server_kv_mib']} MiB (f16)."
        + (f" The run before: commit {before['_meta'].get('commit', '-')}." if before else ""),
        "",
        *tree_table(data, goals),
    ]
    for name in SIDES:
        side = data.get(name)
        if side and "processes" in side:
            was = before.get(name, {}) if before else None
            lines += ["", *roles_table(name, side, was)]
    return "\n".join(lines)
