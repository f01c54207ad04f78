"""Conversations revisited after their KV was evicted: the KV tiers against none, and against
llama-server's host prompt cache (``--cache-ram``), side by side in one run; then a worker killed
and its next turn served from disk.

    python -m benchmarks.serving.multi_turn          # -> benchmarks/results/multi_turn.json
    python -m benchmarks.serving.multi_turn --scratch --conversations 4 --rounds 1 \\
        --sides tiers_off,tiers_disk                  # a trial run

The workload: ``--conversations`` chats, each opened by a system prompt (a passage of the text
the repository holds, drawn by ``--seed``) and grown by one turn a round: a user message (another
passage) and, after the answer, a fixed assistant reply, so that every side is sent the very same
prompts whatever it answers (the answers themselves, ``--answer-tokens`` greedy tokens, are
dropped). A round sends each conversation's next turn, one request at a time, the conversations
in an order drawn anew each round; the workers' KV cache (``--kv-mb``) holds a few of them, so a
conversation's history has been evicted from it by the time its next turn comes.

Sides, each a server started once and idle while another is measured (``--sides``):
``tiers_off`` (pdserve ``single_node``, no tier), ``tiers_host`` (a node-shared tier of
``--host-mb`` in a folder of ``/dev/shm`` of its own), ``tiers_disk`` (that and a disk tier of
``--disk-mb``, every demoted block admitted), ``llama`` (llama-server, one slot, its prompt cache
in RAM of ``--host-mb``). pdserve runs with ``cacheBlockSize`` ``BLOCK_SIZE``. A round measures
every side once (the order rotating, the first round dropped: every history is new then); a
side's figures: TTFT p50 over the round's turns, and the share of the reusable tokens (those a
turn's prompt shares with the conversation's previous one, by the model's tokenizer) that its
answers report cached (``usage.prompt_tokens_details.cached_tokens``; llama-server's
``timings.cache_n``).

After the rounds, unless ``--no-kill``: ``tiers_disk``'s worker, idle for ``IDLE_BEFORE_KILL_S``
(turns come minutes apart: a crash falls between them), is killed (SIGKILL), Ray starts it again,
and every conversation's next turn is sent: each reports how much of its history came from the
tiers the new worker read back (the node-shared tier outlives the process, the disk tier the
node).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.engine.speculation import passages
from benchmarks.harness.client import Target, send
from benchmarks.harness.launch import free_port, start_pdserve, stop_pdserve
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS, paired_rounds, ratio_rounds
from benchmarks.harness.stats import Goal, judge, spread
from benchmarks.llamacpp.server import LlamaServer, ServerSetting, gguf_of, server_folder
from benchmarks.serving.workload import WorkItem
from engine.model.model_files import load_tokenizer, resolve_model_dir

SIDES = ("tiers_off", "tiers_host", "tiers_disk", "llama")
BLOCK_SIZE = 32
ASSISTANT_REPLY = "Thank you, noted. I will keep that in mind for what follows."
GOALS = {
    ("tiers_disk", "tiers_off"): Goal(0.4, at_least=False),
    ("tiers_disk", "llama"): Goal(0.7, at_least=False),
}
REUSE_GOAL = 0.85  # cached / reusable tokens, tiers on
RESTART_GOAL = 0.9  # cached / history tokens, the first turn after a restart
IDLE_BEFORE_KILL_S = 2.0  # the worker idle this long before it is killed


@dataclass
class Conversation:
    system: str
    turns: list[str] = field(default_factory=list)  # user messages sent so far

    def messages(self, user: str) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": self.system}]
        for sent in self.turns:
            messages += [
                {"role": "user", "content": sent},
                {"role": "assistant", "content": ASSISTANT_REPLY},
            ]
        return [*messages, {"role": "user", "content": user}]


@dataclass
class Side:
    target: Target
    process: Any = None  # pdserve's coordinator process, for its workers' pids
    manage_url: str = ""


class Workload:
    """The conversations and their turns, the same for every side."""

    def __init__(self, tokenizer: Any, count: int, seed: int, chars: int = 0) -> None:
        """``chars``: each passage cut to that many characters (0: whole)."""
        self.tokenizer = tokenizer
        self.rng = random.Random(f"multi_turn/{seed}")
        self.texts = [p[:chars] if chars else p for p in passages()]
        self.conversations = [Conversation(self.rng.choice(self.texts)) for _ in range(count)]
        self.last: list[list[int]] = [[] for _ in range(count)]  # each one's latest prompt

    def round_prompts(self) -> list[tuple[str, int]]:
        """Each conversation's next turn, in an order drawn now, as (prompt, reusable tokens:
        those it shares with the conversation's previous prompt)."""
        turns = []
        for index, conversation in enumerate(self.conversations):
            user = self.rng.choice(self.texts)
            prompt = self.tokenizer.apply_chat_template(
                conversation.messages(user), add_generation_prompt=True, tokenize=False
            )
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            turns.append((prompt, _common_prefix(self.last[index], ids)))
            conversation.turns.append(user)
            self.last[index] = ids
        self.rng.shuffle(turns)
        return turns


def _common_prefix(a: list[int], b: list[int]) -> int:
    return len(os.path.commonprefix([a, b]))


@dataclass
class Turns:
    """What a side's turns of a round gave: TTFT and (cached, reusable) tokens per turn."""

    ttft_s: list[float] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    reusable: list[int] = field(default_factory=list)

    @property
    def reuse(self) -> float | None:
        total = sum(self.reusable)
        return (
            sum(min(c, r) for c, r in zip(self.cached, self.reusable, strict=True)) / total
            if total
            else None
        )


async def _turns(target: Target, prompts: list[tuple[str, int]], tokens: int) -> Turns:
    out = Turns()
    # a connection per turn: llama-server may close a kept-alive one just as it is reused
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=limits) as client:
        for prompt, reusable in prompts:
            record = await send(client, target, WorkItem(prompt, tokens))
            if not record.ok or record.ttft_s is None:
                raise RuntimeError(f"{target.url}: a turn failed: {record.error}")
            out.ttft_s.append(record.ttft_s)
            out.cached.append(record.cached_tokens or 0)
            out.reusable.append(reusable)
    return out


def run_turns(side: Side, prompts: list[tuple[str, int]], tokens: int) -> Turns:
    return asyncio.run(_turns(side.target, prompts, tokens))


@contextlib.contextmanager
def pdserve_side(args: argparse.Namespace, name: str) -> Iterator[Side]:
    backend: dict[str, Any] = {
        "stepTargetMs": 0,
        "cacheBlockSize": BLOCK_SIZE,
        "kvCacheMemoryMB": args.kv_mb,
    }
    host = Path(f"/dev/shm/pdserve-multi-turn-{os.getpid()}-{name}")
    if name in ("tiers_host", "tiers_disk"):
        backend |= {"kv_host_tier_mb": args.host_mb, "kv_host_tier_path": str(host)}
    if name == "tiers_disk":
        backend |= {
            "kv_disk_tier_mb": args.disk_mb,
            "kv_disk_tier_path": str(args.workdir / f"{name}-disk"),
            "kv_disk_admit_after": 1,
        }
    process, ports = start_pdserve("single_node", args.model, args.workdir / name, backend)
    try:
        yield Side(
            Target(f"http://127.0.0.1:{ports['predict_port']}", api="completions"),
            process,
            f"http://127.0.0.1:{ports['manage_port']}/v1/instances",
        )
    finally:
        stop_pdserve(process)
        shutil.rmtree(host, ignore_errors=True)


@contextlib.contextmanager
def llama_side(args: argparse.Namespace) -> Iterator[Side]:
    folder = server_folder(args.llama_cpp_dir)
    setting = ServerSetting(slots=1, threads=args.threads)
    extra = ("--cache-ram", str(args.host_mb))
    log = args.workdir / "llama.log"
    server = LlamaServer(folder, gguf_of(args.model), free_port(), log, setting, extra=extra)
    try:
        yield Side(Target(server.url, api="completions", model="llama"))
    finally:
        server.stop()


def kill_and_return(side: Side, prompts: list[tuple[str, int]], tokens: int) -> dict[str, Any]:
    """Kill the side's worker, wait for Ray's restart, send ``prompts``: the share of each
    history served from the tiers the new worker read back."""
    time.sleep(IDLE_BEFORE_KILL_S)  # a crash between turns, not in the middle of one
    before = httpx.get(side.manage_url, timeout=10).json()
    pids = {entry["pid"] for entry in _instances(before)}
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        time.sleep(2)
        with contextlib.suppress(httpx.HTTPError, ValueError):
            now = {e["pid"] for e in _instances(httpx.get(side.manage_url, timeout=10).json())}
            if now and not now & pids:
                break
    else:
        raise TimeoutError("the killed worker did not come back in 300 s")
    turns = run_turns(side, prompts, tokens)
    shares = [min(c / r, 1.0) for c, r in zip(turns.cached, turns.reusable, strict=True) if r]
    return {
        "killed_pids": sorted(pids),
        "turns": len(shares),
        "history_cached": spread(shares, 3),
        "hits": sum(share >= RESTART_GOAL for share in shares),
        "goal": f">= {RESTART_GOAL:.0%} of the history cached, every turn",
        "verdict": "met" if shares and min(shares) >= RESTART_GOAL else "missed",
    }


def _instances(body: Any) -> list[dict[str, Any]]:
    entries = body.get("instances", body) if isinstance(body, dict) else body
    return [e for e in entries if isinstance(e, dict) and e.get("pid")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "multi_turn")
    parser.add_argument("--model", default="bundled", help="pdserve's model_path (a GGUF file)")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"of {SIDES}")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--answer-tokens", type=int, default=8)
    parser.add_argument("--passage-chars", type=int, default=0, help="cut passages (0: whole)")
    parser.add_argument("--kv-mb", type=int, default=96, help="each pdserve worker's KV cache")
    parser.add_argument("--host-mb", type=int, default=2048, help="host tier / --cache-ram")
    parser.add_argument("--disk-mb", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--threads", type=int, default=2, help="llama-server's")
    parser.add_argument("--seed", type=int, default=11, help="draws the conversations")
    parser.add_argument("--no-kill", action="store_true", help="skip the killed worker")
    parser.add_argument("--llama-cpp-dir", type=Path)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/pdserve-multi-turn"))
    args = parser.parse_args(argv)
    names = [n for n in args.sides.split(",") if n]
    if not names or not set(names) <= set(SIDES):
        raise SystemExit(f"--sides takes some of {SIDES}, got {args.sides!r}")
    result_file = ResultFile.start(args, argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(resolve_model_dir(args.model))
    workload = Workload(tokenizer, args.conversations, args.seed, args.passage_chars)
    planned = [workload.round_prompts() for _ in range(1 + args.rounds)]  # the first dropped
    result: dict[str, Any] = {
        "file": gguf_of(args.model).name if "llama" in names else Path(args.model).name,
        "conversations": args.conversations,
        "block_size": BLOCK_SIZE,
        "kv_mb": args.kv_mb,
        "host_mb": args.host_mb,
        "disk_mb": args.disk_mb,
        "answer_tokens": args.answer_tokens,
        "seed": args.seed,
        "sides": {},
    }
    with contextlib.ExitStack() as stack:
        sides = {
            name: stack.enter_context(
                llama_side(args) if name == "llama" else pdserve_side(args, name)
            )
            for name in names
        }
        progress = {name: iter(planned) for name in names}
        turns: dict[str, list[Turns]] = {name: [] for name in names}

        def side(name: str) -> float:
            got = run_turns(sides[name], next(progress[name]), args.answer_tokens)
            turns[name].append(got)
            return statistics.median(got.ttft_s)

        kept = paired_rounds({name: (lambda n=name: side(n)) for name in names}, args.rounds)
        for name in names:
            reuse = [t.reuse for t in turns[name][1:] if t.reuse is not None]
            result["sides"][name] = {
                "ttft_p50_s": spread(kept[name], 4),
                "reuse": spread(reuse, 3) if reuse else None,
            }
            if name != "tiers_off" and len(reuse) == args.rounds:
                verdict = judge(reuse, Goal(REUSE_GOAL)).verdict
                result["sides"][name]["reuse_goal"] = f">= {REUSE_GOAL}: {verdict}"
        result["ratios"] = {}
        for (ours, theirs), goal in GOALS.items():
            if ours in names and theirs in names:
                rounds = ratio_rounds(kept, ours, theirs)
                result["ratios"][f"{ours}/{theirs}"] = {
                    **spread(rounds, 3), "goal": str(goal), "verdict": judge(rounds, goal).verdict,
                }  # fmt: skip
        result_file.write(result, complete=False)
        if "tiers_disk" in names and not args.no_kill:
            result["restart"] = kill_and_return(
                sides["tiers_disk"], workload.round_prompts(), args.answer_tokens
            )
    result_file.write(result)


if __name__ == "__main__":
    main()
