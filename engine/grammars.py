"""Constraints compiled into token matchers (llguidance), once per distinct spec, and each
constrained request's matcher state.

:class:`GrammarCache` compiles a :class:`~engine.constraint.Constraint` against the engine's
tokenizer into a pristine ``LLMatcher`` kept in an LRU (keyed by the spec's digest; one cache per
tokenizer, bounded in entries and in estimated bytes); a request gets a copy (``deep_copy``:
microseconds). A spec that does not compile is remembered and refused at once the next time.
Compiling takes milliseconds and drops the GIL; a worker compiles a request's constraint on its
own thread before the request reaches the engine thread (:meth:`GrammarCache.compile`), so a step
never waits for one. The parser's resource limits (:data:`LIMITS`) and the spec's size bound
every compile and every mask; a step's masks are computed on threads of their own during the
model's forward, each within a CPU budget (``engine.mask_pool``), and a request whose mask
fails or runs past it fails (``constraint_violated``) without holding up the rest of the batch.

:class:`GrammarState` is a request's matcher and how many of its output tokens it has consumed:
:meth:`GrammarState.catch_up` replays the outputs it has not seen. A request handed off or
migrated arrives with outputs made elsewhere; its fresh matcher replays them before its first
step here, and a token its grammar does not accept ends the request with an error (a prefill
side's token is checked, not trusted).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np

from engine.constraint import Constraint
from engine.errors import GrammarError
from engine.mask_pool import MaskJob, MaskPool

if TYPE_CHECKING:
    import torch
    from llguidance._lib import JsonCompileOptions

CACHE_SIZE = 256  # compiled grammars kept per engine, at most
CACHE_BYTES = 64 * 1024 * 1024  # and at most this much of them, by :func:`estimated_bytes`
REFUSED_SIZE = 1024  # refused specs remembered per engine (their digest and the reason)
# the parser's bounds: at ~50k fuel/ms a compile's lexer work stays under ~20 ms, a mask's
# under ~1 ms; a mask's parse items under 2k (a few ms: an ambiguous grammar's items grow every
# token, and past that it fails, where unbounded one mask cost ~1 s on a 49k vocabulary); a
# grammar past 100k symbols is refused
LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=50_000,
    step_max_items=2_000,
    max_grammar_size=100_000,
)
# JSON as ``json.dumps`` writes it: one space after ``,`` and ``:``, no other whitespace (a
# schema's own ``x-guidance`` options override these)
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def estimated_bytes(grammar: str) -> int:
    """What a compiled matcher of ``grammar`` (llguidance's text of it) holds, erring high:
    64 KiB, and 128 bytes per character (measured on a 49k vocabulary: 6-200 KB for grammars
    of 0.8-3 KB; llguidance does not report its own)."""
    return 64 * 1024 + 128 * len(grammar)


@dataclass
class CompileStats:
    """Counters for metrics: compiles, cache hits, the seconds each compile took (until taken),
    compiles that failed and specs refused again without compiling, and the rows masked and the
    seconds the engine thread spent on masks (waiting for them past the forward, applying
    them), over every step so far."""

    compiles: int = 0
    hits: int = 0
    failed_compiles: int = 0
    refusals: int = 0
    seconds: list[float] = field(default_factory=list)
    masked_rows: int = 0
    mask_seconds: float = 0.0

    def take_seconds(self) -> list[float]:
        taken, self.seconds = self.seconds, []
        return taken


class GrammarCache:
    """Compiled matchers for one tokenizer (thread-safe: workers compile on their own threads),
    at most ``capacity`` of them and ``capacity_bytes`` by :func:`estimated_bytes`, the least
    recently used evicted first; and the specs refused, so a spec refused once is refused again
    at once, with the same message, without compiling (a spec's refusal is deterministic)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int] = (),
        capacity: int = CACHE_SIZE,
        capacity_bytes: int = CACHE_BYTES,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = max(vocab_size, len(tokenizer))
        self._eos = sorted(eos_token_ids)
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, tuple[llguidance.LLMatcher, int]] = OrderedDict()
        self._refused: OrderedDict[str, str] = OrderedDict()
        self.num_bytes = 0  # the compiled matchers' estimated size
        self._lock = threading.Lock()
        self._masks = MaskPool()
        self.stats = CompileStats()

    def __len__(self) -> int:
        with self._lock:
            return len(self._compiled)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance view of the tokenizer (built once: ~0.6 s for a 49k vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None
                )
            return self._tokenizer

    def known(self, constraint: Constraint) -> bool:
        """Whether ``constraint`` is answered without compiling: compiled, or refused, before."""
        with self._lock:
            return constraint.key in self._compiled or constraint.key in self._refused

    def compile(self, constraint: Constraint | None) -> llguidance.LLMatcher | None:
        """The pristine matcher of ``constraint`` (compiled now unless cached); raises
        :class:`GrammarError` naming why it does not compile. None for no constraint."""
        if constraint is None:
            return None
        key = constraint.key
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                self.stats.hits += 1
                return self._compiled[key][0]
            if key in self._refused:
                self._refused.move_to_end(key)
                self.stats.refusals += 1
                raise GrammarError(self._refused[key])
        start = time.perf_counter()
        try:
            grammar = grammar_of(constraint)
            matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
            if matcher.is_error():
                message = f"the {constraint.kind} does not compile: {_error_text(matcher)}"
                raise GrammarError(message)
        except GrammarError as exc:
            self._refuse(key, str(exc))
            raise
        with self._lock:
            self.stats.compiles += 1
            self.stats.seconds.append(time.perf_counter() - start)
            self._keep(key, matcher, estimated_bytes(grammar))
        return matcher

    def _keep(self, key: str, matcher: llguidance.LLMatcher, num_bytes: int) -> None:
        """Cache ``matcher``, evicting the least recently used past either bound (the newest
        stays even alone past the byte bound: its requests are about to use it)."""
        if key in self._compiled:
            self.num_bytes -= self._compiled.pop(key)[1]
        self._compiled[key] = (matcher, num_bytes)
        self.num_bytes += num_bytes
        while len(self._compiled) > 1 and (
            len(self._compiled) > self.capacity or self.num_bytes > self.capacity_bytes
        ):
            self.num_bytes -= self._compiled.popitem(last=False)[1][1]

    def _refuse(self, key: str, message: str) -> None:
        with self._lock:
            self.stats.failed_compiles += 1
            self._refused[key] = message
            while len(self._refused) > REFUSED_SIZE:
                self._refused.popitem(last=False)

    def mask(self, logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
        """Set to -inf, in place, every token ``states[i]`` does not allow next in row
        ``rows[i]`` of ``logits`` (``[batch, vocab]``): :meth:`start_masks` then
        :meth:`apply_masks`."""
        self.apply_masks(logits, self.start_masks(rows, states))

    def start_masks(self, rows: list[int], states: list[GrammarState]) -> PendingMasks:
        """Start computing the masks of ``states`` (rows ``rows`` of the logits to come), on
        threads of their own (``engine.mask_pool``): they may run during the model's forward."""
        import torch  # the engine's side only: a coordinator compiles grammars without torch

        bitmask = torch.zeros((len(rows), (self.vocab_size + 31) // 32), dtype=torch.int32)
        job = self._masks.start(bitmask, [state.matcher for state in states])
        return PendingMasks(rows, states, job)

    def apply_masks(self, logits: torch.Tensor, masks: PendingMasks) -> None:
        """Wait for ``masks`` (each row within its CPU budget) and apply them, in place. A row
        allowing few tokens (a JSON structure's) keeps just those; a row allowing many (a
        string's content) adds a 0 / -inf bias looked up a byte of the bitmask at a time
        (``engine.grammar_masks``). A row whose matcher failed or ran past the budget is left as it
        is, its state's ``error`` set: whatever it samples is refused, and the request fails
        rather than finishing on a mask of EOS alone; the other rows go on."""
        from engine.grammar_masks import add_biases, keep_few  # the engine's side: torch

        start = time.perf_counter()
        rows, states, bitmask = masks.rows, masks.states, masks.job.bitmask
        failures = masks.job.finish()
        words_of_rows = bitmask.numpy().view(np.uint32)
        masked = [
            i
            for i, (state, failure) in enumerate(zip(states, failures, strict=True))
            if state.check_mask(words_of_rows[i], failure)
        ]
        dense = [i for i in masked if not keep_few(logits, rows[i], words_of_rows[i])]
        if dense:
            add_biases(logits, [rows[i] for i in dense], bitmask[dense])
        self.stats.masked_rows += len(rows)
        self.stats.mask_seconds += time.perf_counter() - start

    def state(self, constraint: Constraint | None) -> GrammarState | None:
        """A fresh matcher state for one request (None for no constraint)."""
        pristine = self.compile(constraint)
        return None if pristine is None else GrammarState(pristine.deep_copy())


@dataclass
class PendingMasks:
    """A step's masks being computed: for logits rows ``rows``, of ``states``."""

    rows: list[int]
    states: list[GrammarState]
    job: MaskJob


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint."""
    if constraint.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
    if constraint.kind == "json_schema":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(constraint.spec, JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"the json_schema is not accepted: {exc}") from exc
    if constraint.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
    return llguidance.LLMatcher.grammar_from_lark(constraint.spec)


def _error_text(matcher: llguidance.LLMatcher) -> str:
    """The matcher's error on one line, up to the source excerpt or the parser state it appends,
    at most 300 chars."""
    text = matcher.get_error().split("<state>")[0]
    lines = [line.strip() for line in text.strip().splitlines()]
    kept = [line for line in lines if line and not line[0].isdigit() and line != "^"]
    return " ".join(kept)[:300]


@dataclass
class GrammarState:
    """A request's matcher and how many of its output tokens it has consumed."""

    matcher: llguidance.LLMatcher
    num_consumed: int = 0
    error: str | None = None

    def catch_up(self, output_token_ids: Sequence[int]) -> bool:
        """Consume the outputs not seen yet; False (and ``error`` set) when one is refused or
        the matcher fails."""
        if self.error is not None:
            return False
        for token_id in output_token_ids[self.num_consumed :]:
            if not self.matcher.consume_token(token_id) or self.matcher.is_error():
                self.error = f"token {token_id} does not match the request's constraint" + (
                    f" ({_error_text(self.matcher)})" if self.matcher.is_error() else ""
                )
                return False
            self.num_consumed += 1
        return True

    def check_mask(self, words: np.ndarray, failure: str | None = None) -> bool:
        """True when ``words``, the mask just computed, is one to sample under; else ``error``
        says why not: computing it failed or took too long (``failure``: the matcher is then
        left alone), the matcher failed computing it (llguidance then allows EOS alone), or it
        allows no token at all."""
        if failure is not None:
            self.error = failure
        elif self.matcher.is_error():
            self.error = f"the constraint's matcher failed: {_error_text(self.matcher)}"
        elif not words.any():
            self.error = "the constraint allows no next token"
        return self.error is None

    @property
    def completed(self) -> bool:
        """The grammar takes no more tokens: its output is whole."""
        return self.error is None and self.matcher.is_stopped()
