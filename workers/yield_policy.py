"""When a busy decode worker may pause for a long prefill, and for how long
(workers/core_sharing.py: ``decode_yield_percent``, ``decode_yield_tpot_ms``).

One bound always, two optional (:func:`headroom_s` picks the per-request one):

- :func:`own_prompt_headroom_s`: no pause while a short prompt of the worker's own waits for its
  first token;
- :class:`PauseBudget`, over time: pauses take at most a share of the worker's time in the long
  run, whatever its streams;
- :func:`tpot_headroom_s`, per stream: a pause is only as long as every running stream can
  afford and still end within its time-per-output-token target, counting the time it has taken
  so far and its remaining tokens at the worker's current step time. So a stream that lived
  through one pause is not paused again unless it has made up the time, and a quick machine
  (short steps) gets long pauses while a slow one gets none.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from engine.request import Request

SHORT_PROMPT_TOKENS = 256  # a prompt with fewer left to compute holds pauses until its first token


class PauseBudget:
    """The pause time a lender has earned: ``share`` of the time that passes, never more than one
    whole pause held; a pause needs a whole one and spends what it lasted. So pauses take at most
    ``share`` of the time in the long run, and the first one is there at once. A share of 1
    bounds nothing: a pause may follow a pause."""

    def __init__(self, share: float) -> None:
        self.share = min(max(share, 0.0), 1.0)
        self._earned_s: float | None = None  # None: a whole pause (nothing spent yet)
        self._at: float | None = None

    def allows(self, pause_s: float, now: float, most_s: float | None = None) -> bool:
        """Whether a pause of ``pause_s`` may start ``now``; ``most_s`` (default ``pause_s``):
        the longest pause, and so the most pause time held."""
        if self.share >= 1.0:
            return True
        most_s = pause_s if most_s is None else most_s
        elapsed = 0.0 if self._at is None else max(0.0, now - self._at)
        self._at = now
        earned = most_s if self._earned_s is None else self._earned_s + elapsed * self.share
        self._earned_s = min(most_s, earned)
        return self._earned_s >= pause_s and self.share > 0

    def spend(self, paused_s: float) -> None:
        if self.share < 1.0:
            self._earned_s = max(0.0, (self._earned_s or 0.0) - paused_s)


def _holds_pauses(request: Request) -> bool:
    """A short prompt waiting for its first token here (fewer than ``SHORT_PROMPT_TOKENS`` to
    compute)."""
    return request.num_output_tokens == 0 and request.num_uncomputed_tokens < SHORT_PROMPT_TOKENS


def headroom_s(
    requests: Iterable[Request], target_s: float, step_s: float | None, now: float
) -> float:
    """The longest pause ``requests`` (those queued or being computed here) afford: with a TPOT
    target (``target_s`` > 0), :func:`tpot_headroom_s`, else :func:`own_prompt_headroom_s`."""
    if target_s > 0:
        return tpot_headroom_s(requests, target_s, step_s, now)
    return own_prompt_headroom_s(requests)


def own_prompt_headroom_s(requests: Iterable[Request]) -> float:
    """0 while a short prompt is queued or being computed here (fewer than
    ``SHORT_PROMPT_TOKENS`` to go, no token yet), else ``inf``: its first token comes within a
    step or two, and a pause comes right after it instead of delaying it by the pause's length.
    This holds with no TPOT target too: a decode worker paused back to back for queued long
    prompts would otherwise leave its own short prompts waiting through every pause."""
    return 0.0 if any(map(_holds_pauses, requests)) else math.inf


def tpot_headroom_s(
    streams: Iterable[Request], target_s: float, step_s: float | None, now: float
) -> float:
    """The longest pause after which every stream in ``streams`` can still end within
    ``target_s`` per output token: a stream whose first token came ``e`` seconds ago, with ``n``
    of its ``m`` output tokens made, affords ``target_s * (m - 1) - e - (m - n) * step_s``.

    Each stream is taken to run to its output limit (its remaining tokens are not known
    otherwise); one already behind its target affords nothing, so it is not paused further while
    it runs. A short prompt still being computed here affords nothing either
    (:func:`own_prompt_headroom_s`). A long one is not counted (its first token's latency is not
    a time per output token). ``inf`` for no requests."""
    step_s = step_s or 0.0
    room = math.inf
    for request in streams:
        made = request.num_output_tokens
        if made == 0:
            if _holds_pauses(request):
                return 0.0
            continue
        first = request.first_token_time
        since = 0.0 if first is None else max(0.0, now - first)
        most = request.max_output_tokens
        affords = target_s * max(most - 1, 1) - since - max(most - made, 0) * step_s
        room = min(room, max(affords, 0.0))
    return room
