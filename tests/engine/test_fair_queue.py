"""The waiting queue's order: priority first, then clients in turn within a priority, FCFS within
a client; one client alone (or none) is plain FCFS; a preempted request keeps its turn; a
client arriving late waits behind the round being served, not behind every queued request. On
the scheduler itself (a real block manager, no model): the prompts it admits in one step come in
that order."""

from __future__ import annotations

import itertools
from typing import Any

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.fair_queue import PRUNE_AT, FairQueue
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

ARRIVALS = itertools.count()


def request(name: str, client: str = "", priority: int = 5) -> Request:
    detokenizer: Any = None  # the queue and the scheduler never detokenize
    return Request(
        request_id=name,
        token_ids=[1, 2, 3, 4],
        num_prompt_tokens=4,
        params=SamplingParams(),
        max_output_tokens=4,
        detokenizer=detokenizer,
        priority=priority,
        arrival_seq=next(ARRIVALS),
        client=client,
    )


def drained(queue: FairQueue) -> list[str]:
    names = []
    while queue:
        names.append(queue.pop().request_id)
    return names


def filled(*requests: Request) -> FairQueue:
    queue = FairQueue()
    for each in requests:
        queue.push(each)
    return queue


def test_clients_take_turns_within_a_priority():
    queue = filled(
        request("a1", "a"),
        request("a2", "a"),
        request("a3", "a"),
        request("b1", "b"),
        request("c1", "c"),
        request("b2", "b"),
    )
    assert drained(queue) == ["a1", "b1", "c1", "a2", "b2", "a3"]


def test_priority_comes_before_turns():
    queue = filled(request("a1", "a"), request("a2", "a"), request("b1", "b", priority=1))
    assert drained(queue) == ["b1", "a1", "a2"]


def test_one_client_alone_is_first_come_first_served():
    assert drained(filled(*(request(f"r{i}") for i in range(5)))) == [f"r{i}" for i in range(5)]


def test_a_preempted_request_keeps_its_turn():
    queue = filled(request("a1", "a"), request("b1", "b"), request("a2", "a"))
    first = queue.pop()
    queue.push(first)  # preempted: back in the queue
    assert drained(queue) == ["a1", "b1", "a2"]


def test_a_late_client_waits_for_the_round_being_served_only():
    queue = filled(*(request(f"a{i}", "a") for i in range(4)), request("b0", "b"))
    assert [queue.pop().request_id for _ in range(3)] == ["a0", "b0", "a1"]
    queue.push(request("c0", "c"))
    assert drained(queue) == ["c0", "a2", "a3"]


def test_lines_level_with_the_served_round_are_forgotten():
    queue = FairQueue()
    for index in range(PRUNE_AT - 1):
        queue.push(request(f"r{index}", f"client-{index}"))
        queue.pop()
    queue.push(request("last", "someone"))
    assert len(queue._next) == 1


def test_the_scheduler_admits_prompts_in_turns():
    scheduler = Scheduler(SchedulerConfig(), BlockManager(num_blocks=64, block_size=4))
    for each in (request("a1", "a"), request("a2", "a"), request("b1", "b"), request("a3", "a")):
        scheduler.add(each)
    out = scheduler.schedule()
    assert [r.request_id for r, _ in out.prefills] == ["a1", "b1", "a2", "a3"]
