"""The pair of workers for one request: a pure function of the workers' states and of how much of
the request each would find cached (``coordinator/router.py`` tells the policy in full).

- A prefill worker costs its load plus the tokens it would compute, ``num_tokens`` less its
  cached prefix; among workers whose load is within ``max_prefill_imbalance`` tokens of the least
  loaded one, the cheapest wins (the others only by load).
- A decode worker (the colocated one in ``single_node``, which also computes the prompt) whose
  running requests are within ``max_decode_imbalance`` of the least loaded one is ranked by its
  cached prefix, longest first, then by load, then by free blocks; the others only by load.
- Fresh workers first; a stale one only when no fresh pair is left, never one silent for
  ``STALE_GRACE_S``. In ``pd_separate`` the decode worker prefills a short prompt itself
  (``local_prefill_*``), and does so for every prompt when no prefill worker answers
  (``local_prefill_fallback``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from coordinator.routing.config import RoutingConfig
from coordinator.routing.worker_state import WorkerKey, WorkerState

Pair = tuple[WorkerState | None, WorkerState]  # (None, colocated worker) in single_node
# (prefill instance, decode instance); prefill None: the decode worker prefills it itself
Route = tuple[int | None, int]


@dataclass(frozen=True)
class Choice:
    """The pair chosen, and what it will compute: the prefill worker's tokens (``prefill`` None:
    the decode worker computes ``decode_prefill_tokens`` itself, or it is colocated)."""

    route: Route
    prefill: WorkerState | None
    decode: WorkerState
    prefill_tokens: int = 0
    decode_prefill_tokens: int = 0


def candidate_pairs(
    prefills: Sequence[WorkerState],
    decodes: Sequence[WorkerState],
    exclude: AbstractSet[Route],
    now: float,
    fallback: bool,
) -> list[Pair]:
    """Fresh pairs; else, when no prefill worker answers (pd_separate, ``fallback``), fresh
    decode workers that prefill locally; else pairs of workers not yet given up on."""
    fresh = _pairs(prefills, decodes, exclude, lambda w: w.fresh)
    prefill_answers = any(p.fresh for p in prefills)
    if fresh or prefill_answers or not prefills or not fallback:
        return fresh or _pairs(prefills, decodes, exclude, lambda w: w.reachable(now))
    local: list[Pair] = [
        (None, d) for d in decodes if d.fresh and (None, d.instance) not in exclude
    ]
    return local or _pairs(prefills, decodes, exclude, lambda w: w.reachable(now))


def choose_pair(
    pairs: Sequence[Pair],
    has_prefill_workers: bool,
    num_tokens: int,
    cached: dict[WorkerKey, int],
    exclude: AbstractSet[Route],
    routing: RoutingConfig,
) -> Choice:
    """The cheapest of ``pairs`` (not empty) for a request computing ``num_tokens`` (prompt and
    outputs so far) of which each worker would find ``cached[key]`` tokens cached."""
    least_prefill = min(p.prefill_cost if p is not None else 0 for p, _ in pairs)
    least = (least_prefill, min(d.decode_load for _, d in pairs))
    p, d = min(pairs, key=lambda pair: _cost(pair, num_tokens, cached, least, routing))
    local = p is None and has_prefill_workers
    num_local = num_tokens - cached[d.key]  # what the decode worker would compute
    on_decode = p is not None and _prefill_locally(p, d, num_local, routing)
    if on_decode and (None, d.instance) not in exclude:
        p, local = None, True
    if p is not None:
        return Choice((p.instance, d.instance), p, d, prefill_tokens=num_tokens - cached[p.key])
    if local:
        return Choice((None, d.instance), None, d, decode_prefill_tokens=num_local)
    return Choice((0, d.instance), None, d)


def _prefill_locally(
    p: WorkerState, d: WorkerState, num_local: int, routing: RoutingConfig
) -> bool:
    """Whether decode worker ``d`` computes the prompt itself: ``num_local`` (what it would
    compute) is short, or shorter than prefill worker ``p``'s long queue. Either way only while
    ``d``'s own prompt tokens to compute, this prompt's included, stay within the short limit or
    below ``p``'s queue: a decode worker that is already prefilling would slow its streams for
    longer than a hand-off takes."""
    backlog = d.prefill_cost + num_local
    short = routing.local_prefill_tokens
    if short and num_local <= short and backlog <= max(short, p.prefill_cost):
        return True
    queue = routing.local_prefill_queue_tokens
    return bool(queue) and p.prefill_cost >= queue and backlog < p.prefill_cost


def _cost(
    pair: Pair,
    num_tokens: int,
    cached: dict[WorkerKey, int],
    least: tuple[float, int],
    routing: RoutingConfig,
) -> tuple[float, ...]:
    """A pair's cost, prefill first, given the least prefill and decode loads among the
    candidates. Without cached prefixes (or with ``prefix_routing`` off) it orders pairs as their
    loads alone do."""
    p, d = pair
    least_prefill, least_decode = least
    if p is None:
        prefill: tuple[float, ...] = (0, 0)
    elif p.prefill_cost > least_prefill + routing.max_prefill_imbalance:
        prefill = (1, p.prefill_cost)
    else:
        prefill = (0, p.prefill_cost + num_tokens - cached[p.key])
    free = -d.stats.num_free_blocks
    if d.decode_load > least_decode + routing.max_decode_imbalance:
        return (*prefill, 1, 0, d.decode_load, free)
    return (*prefill, 0, -cached[d.key], d.decode_load, free)


def _pairs(
    prefills: Sequence[WorkerState],
    decodes: Sequence[WorkerState],
    exclude: AbstractSet[Route],
    usable: Callable[[WorkerState], bool],
) -> list[Pair]:
    usable_prefills: list[WorkerState | None] = [p for p in prefills if usable(p)]
    if not prefills:  # single_node: the colocated worker does it all
        usable_prefills = [None]
    return [
        (p, d)
        for p in usable_prefills
        for d in decodes
        if usable(d)
        and (p.instance if p else 0, d.instance) not in exclude
        and (None, d.instance) not in exclude  # failed prefilling there itself
    ]
