"""Speculative decoding: n-gram drafts checked several tokens per weight read, exact to the token.

A decoding request's step normally computes one token, its last sampled one. With a draft (the
tokens that followed the latest earlier occurrence of its last few tokens: ``NgramDrafter``), the
step computes the last token and the drafted ones as consecutive decode rows of one sequence
(each row attends to the rows before it), and the engine then samples row after row: row j's
token is drawn exactly as a one-token step at that position would draw it (the request's penalties
over its outputs so far, its seeded draw at that output position), appended and streamed; while
it equals draft token j, row j + 1 (computed on that very token) is valid too and is sampled next.
The first token that differs from the draft ends the check; it is the model's own token, so every
check yields at least one. The rows after it are dropped: the request's computed tokens count
only accepted ones, so their KV slots are rewritten before any block holding them is full and
hashed, and blocks taken for them beyond the request's tokens are freed.

The tokens are those of decoding without drafts, for greedy and for every seed, because a row's
logits are bit for bit those of a one-token step: the engine is batch invariant while it
speculates (``LlamaModel.set_batch_invariant``), so a row is computed alike whatever shares its
step. A draft costs nothing to carry: it is rebuilt from the request's tokens every step, so a
hand-off or a migration moves nothing new.

Worth it, or not at all: a drafted row costs compute whether its token is accepted or not. The
speculator fits the engine's decode steps to ``a + b * rows`` seconds (:class:`StepCost`); in a
step of ``n`` decode rows a drafted token pays for itself when the share of it accepted beats
``b * n / (a + b * n)`` (a step's tokens per second then rise; the fit's steps include their
scheduling, where drafts are made), so a request drafts only while its
own acceptance (its accepted / drafted tokens, the older checks fading, the engine's as a prior)
clears that share: on one stream a cheap row is worth a low acceptance, in a full batch of rows
bound by compute almost none is. A request below it drafts again after ``PROBE_AFTER_STEPS``
steps, once, to learn whether its text turned quotable. Its draft length grows by one after a
fully accepted draft and falls to the accepted count plus one otherwise; after
``MISSES_TO_PAUSE`` drafts in a row with nothing accepted it pauses for a number of steps that
doubles with every further miss, up to ``MAX_PAUSE_STEPS``. A step grows to at most
``max_step_rows`` rows with drafts.

A constrained request's draft is cut where its grammar stops allowing it (the matcher checks the
draft without consuming it), and each of its rows is masked when it is sampled, by the matcher
as the accepted tokens before it left it: the matcher only ever consumes real outputs, so a
rejected token has nothing to roll back. Not drafted: prefill-only requests (they stop at their
first token) and requests that opted out (``SamplingParams.speculative``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from engine.config import SpeculativeConfig
from engine.ngram_drafter import NgramDrafter
from engine.request import Request

MISSES_TO_PAUSE = 3
MAX_PAUSE_STEPS = 64
ACCEPTANCE_FADING = 0.2  # what an older check loses of its weight per newer check
PRIOR_ACCEPTANCE = 0.5  # the engine's before any check
PRIOR_TOKENS = 4.0  # drafted tokens' worth of weight a request's prior acceptance has
PROBE_AFTER_STEPS = 8
COST_SMOOTHING = 0.05  # weight of a step in the step cost fit
PRIOR_ROW_SHARE = 0.25  # a row's cost / a step's fixed cost, until steps of several sizes are seen
MIN_ROWS_SPREAD = 0.5  # rows: the standard deviation of the steps seen that fits a slope
MIN_FIXED_SHARE = 0.1  # of the mean step: the least fixed cost a fit may give
# a drafted token must beat the break-even by this much: the fit is of steps as they were, and
# a step with more rows also waits longer for its slowest thread, which a mean hides
BREAK_EVEN_MARGIN = 1.2


@dataclass
class Acceptance:
    """Accepted / drafted tokens over checks, each older check's tokens fading."""

    accepted: float
    drafted: float

    @classmethod
    def prior(cls, rate: float) -> Acceptance:
        return cls(rate * PRIOR_TOKENS, PRIOR_TOKENS)

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted > 0 else 0.0

    def add(self, drafted: int, accepted: int) -> None:
        self.accepted = self.accepted * (1 - ACCEPTANCE_FADING) + accepted
        self.drafted = self.drafted * (1 - ACCEPTANCE_FADING) + drafted


@dataclass
class DraftState:
    """A request's speculation so far: its next draft length, its acceptance, its run of
    misses, the steps it sits out and whether its next draft is a probe."""

    length: int
    acceptance: Acceptance
    misses: int = 0
    paused_steps: int = 0
    probing: bool = False


class StepCost:
    """A decode step's seconds as ``a + b * rows``, fitted by least squares to the steps seen,
    each step's weight fading by ``COST_SMOOTHING`` per newer step. Only the ratio ``b / a``
    decides (:meth:`break_even`); while the steps seen hardly differ in rows (their spread under
    ``MIN_ROWS_SPREAD``), it is ``PRIOR_ROW_SHARE``'s."""

    def __init__(self) -> None:
        self._sums = [0.0] * 5  # weight, sum x, sum y, sum x^2, sum xy

    def observe(self, rows: int, seconds: float) -> None:
        for i, value in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            self._sums[i] = self._sums[i] * (1 - COST_SMOOTHING) + COST_SMOOTHING * value

    def row_share(self) -> float:
        """``b / a``: what a row costs, as a share of a step's fixed cost."""
        w, sx, sy, sxx, sxy = self._sums
        if w <= 0 or (w * sxx - sx * sx) / (w * w) < MIN_ROWS_SPREAD**2:
            return PRIOR_ROW_SHARE
        b = max((w * sxy - sx * sy) / (w * sxx - sx * sx), 0.0)
        a = max((sy - b * sx) / w, MIN_FIXED_SHARE * sy / w)  # noise never makes it vanish
        return b / a

    def break_even(self, rows: int) -> float:
        """The acceptance a drafted token needs in a step of ``rows`` decode rows to raise the
        step's tokens per second: ``b * rows / (a + b * rows)``, times ``BREAK_EVEN_MARGIN``."""
        share = self.row_share() * rows
        return BREAK_EVEN_MARGIN * share / (1 + share)


@dataclass
class SpeculationStats:
    """Counters since the engine started: checks made, tokens drafted and accepted, and how
    many checks accepted k tokens (``accepted_histogram[k]``)."""

    checks: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_histogram: Counter[int] = field(default_factory=Counter)


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_seq_len: int) -> None:
        self.config = config
        self.max_seq_len = max_seq_len
        self.drafter = NgramDrafter(config.min_match, config.max_match, config.max_draft)
        self.stats = SpeculationStats()
        self.step_cost = StepCost()
        self.acceptance = Acceptance.prior(PRIOR_ACCEPTANCE)  # the engine's: a request's prior

    def draft(self, request: Request, room: int, decode_rows: int) -> list[int]:
        """Tokens to check after ``request``'s last one this step (of ``decode_rows`` decode
        rows), at most ``room``; none where they would not pay for their rows."""
        if not _may_draft(request):
            return []
        state = request.draft_state
        if state is None:
            prior = Acceptance.prior(self.acceptance.rate)
            state = request.draft_state = DraftState(self.config.max_draft, prior)
        if state.paused_steps > 0:
            state.paused_steps -= 1
            state.probing = state.paused_steps == 0
            return []
        if not state.probing and state.acceptance.rate <= self.step_cost.break_even(decode_rows):
            state.paused_steps = PROBE_AFTER_STEPS
            return []
        state.probing = False
        # no token past the request's limits: the last check's own token is one more
        left = min(
            request.max_output_tokens - request.num_output_tokens,
            self.max_seq_len - request.num_tokens,
        )
        limit = min(room, state.length, left - 1)
        draft = self.drafter.draft(request.token_ids, limit) if limit > 0 else []
        return _allowed(request, draft) if draft and request.grammar is not None else draft

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode-only step of ``rows`` rows (drafted ones included) took ``seconds``."""
        self.step_cost.observe(rows, seconds)

    def record(self, request: Request, drafted: int, accepted: int) -> None:
        """A check of ``drafted`` tokens accepted ``accepted`` of them."""
        stats, state = self.stats, request.draft_state
        stats.checks += 1
        stats.drafted += drafted
        stats.accepted += accepted
        stats.accepted_histogram[accepted] += 1
        self.acceptance.add(drafted, accepted)
        if state is None:
            return
        state.acceptance.add(drafted, accepted)
        if accepted == drafted:
            state.length = min(self.config.max_draft, state.length + 1)
        else:
            state.length = accepted + 1
        state.misses = 0 if accepted else state.misses + 1
        if state.misses >= MISSES_TO_PAUSE:
            state.paused_steps = min(2 ** (state.misses - MISSES_TO_PAUSE + 2), MAX_PAUSE_STEPS)


def _may_draft(request: Request) -> bool:
    return not request.prefill_only and request.params.speculative and request.is_decoding


def _allowed(request: Request, draft: list[int]) -> list[int]:
    """The part of ``draft`` a constrained request's grammar allows after its outputs so far
    (nothing when its matcher refuses them: its next token fails it)."""
    state = request.grammar
    assert state is not None
    if not state.catch_up(request.output_token_ids):
        return []
    return draft[: state.matcher.validate_tokens(draft)]
