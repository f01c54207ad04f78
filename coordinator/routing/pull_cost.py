"""Whether a prefill worker should pull a prompt's leading blocks from a peer (``kv_peer_pull``;
``engine/kv_pull.py``) instead of computing them: a cost model from run-time measurements.

Computing ``n`` blocks costs ``n × block_size × token_s``, the prefill worker's own learnt
compute time of a prompt token (``EngineStats.prompt_token_seconds``). A pull of ``n`` blocks
costs ``overhead_s + n × block_s``: the coordinator times every pull from the call that opens it
to the peer's acknowledgement, and the two terms are a least-squares fit over the pulls made
(recent ones weighing more; the priors, as two pulls of ``PRIOR_SIZES`` blocks, until pulls of
other sizes outweigh them). A pull that installs nothing is a sample of zero blocks (it was all
overhead), its time capped at ``FAILURE_CAP`` times the estimate it was planned on: one pull
stuck until its timeout must not switch pulls off for good. A pull is planned only when it is
estimated at ``MARGIN`` of the compute or less, for at least ``MIN_BLOCKS`` blocks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from coordinator.decayed_line import DecayedLine
from coordinator.routing.worker_state import WorkerKey

PRIOR_OVERHEAD_S = 0.01  # two calls and a handshake, until measured
PRIOR_BLOCK_S = 0.001  # one block's export, transfer and install, until measured
PRIOR_SIZES = (1, 16)  # the pulls (in blocks) the priors count as
MARGIN = 0.7  # a pull is planned when it costs at most this share of the compute it saves
MIN_BLOCKS = 2
DECAY = 0.95  # the weight an older sample keeps per newer one
FAILURE_CAP = 3.0


@dataclass(frozen=True)
class PullPlan:
    """Take the first ``num_blocks`` blocks of the prompt from worker ``source``."""

    source: WorkerKey
    num_blocks: int


class PullCosts:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pulls = DecayedLine(DECAY)  # (blocks, seconds) of the pulls made
        for size in PRIOR_SIZES:
            self._pulls.add(size, PRIOR_OVERHEAD_S + size * PRIOR_BLOCK_S)
        self.measured = 0

    @property
    def terms(self) -> tuple[float, float]:
        """``(overhead_s, block_s)`` as fitted now."""
        moments = self._pulls.moments()
        assert moments is not None  # the priors are samples
        mean_x, mean_y, spread, covariance = moments
        slope = covariance / spread if spread > 1e-9 else PRIOR_BLOCK_S
        slope = max(slope, 1e-6)
        return max(mean_y - slope * mean_x, 0.0), slope

    def estimate(self, num_blocks: int) -> float:
        overhead, block_s = self.terms
        return overhead + num_blocks * block_s

    def worth(self, num_blocks: int, block_compute_s: float) -> bool:
        """Whether pulling ``num_blocks`` beats computing them at ``block_compute_s`` each."""
        if num_blocks < MIN_BLOCKS or block_compute_s <= 0:
            return False
        return self.estimate(num_blocks) <= MARGIN * num_blocks * block_compute_s

    def record(self, seconds: float, num_blocks: int, num_asked: int = 0) -> None:
        """A pull that took ``seconds`` and installed ``num_blocks`` of the ``num_asked``
        blocks planned (0 installed: it failed)."""
        with self._lock:
            self.measured += 1
            if num_blocks <= 0:
                seconds = min(seconds, FAILURE_CAP * self.estimate(max(num_asked, 1)))
            self._pulls.add(num_blocks, seconds)
