"""Whether a prefill worker should pull a prompt's leading blocks from a peer (``kv_peer_pull``;
``engine/kv_pull.py``) instead of computing them: a cost model from run-time measurements.

Computing ``n`` blocks costs ``n × block_size × token_s``, the prefill worker's own learnt
compute time of a prompt token (``EngineStats.prompt_token_seconds``). A pull of ``n`` blocks
costs ``overhead_s + n × block_s``: the coordinator times every pull from the call that opens it
to the peer's acknowledgement and keeps a moving average of each term, fitted from the pulls'
sizes (``PRIOR_*`` until pulls were measured). A pull that installs nothing counts its whole
time against the model. A pull is planned only when it is estimated at ``MARGIN`` of the
compute or less, for at least ``MIN_BLOCKS`` blocks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from coordinator.routing.worker_state import WorkerKey

PRIOR_OVERHEAD_S = 0.01  # two calls and a handshake, until measured
PRIOR_BLOCK_S = 0.001  # one block's export, transfer and install, until measured
MARGIN = 0.7  # a pull is planned when it costs at most this share of the compute it saves
MIN_BLOCKS = 2
ALPHA = 0.2  # the moving averages' weight of a new measurement


@dataclass(frozen=True)
class PullPlan:
    """Take the first ``num_blocks`` blocks of the prompt from worker ``source``."""

    source: WorkerKey
    num_blocks: int


class PullCosts:
    def __init__(self) -> None:
        self.overhead_s = PRIOR_OVERHEAD_S
        self.block_s = PRIOR_BLOCK_S
        self.measured = 0
        self._lock = threading.Lock()

    def estimate(self, num_blocks: int) -> float:
        return self.overhead_s + num_blocks * self.block_s

    def worth(self, num_blocks: int, block_compute_s: float) -> bool:
        """Whether pulling ``num_blocks`` beats computing them at ``block_compute_s`` each."""
        if num_blocks < MIN_BLOCKS or block_compute_s <= 0:
            return False
        return self.estimate(num_blocks) <= MARGIN * num_blocks * block_compute_s

    def record(self, seconds: float, num_blocks: int) -> None:
        """A pull that took ``seconds`` and installed ``num_blocks`` blocks (0: failed)."""
        with self._lock:
            self.measured += 1
            if num_blocks <= 0:  # all of it wasted: as if it were pure overhead
                self.overhead_s += ALPHA * (seconds - self.overhead_s)
                return
            # split the time by the model's current shares, then move each term toward its part
            predicted = self.estimate(num_blocks)
            scale = seconds / predicted if predicted > 0 else 1.0
            self.overhead_s += ALPHA * (self.overhead_s * scale - self.overhead_s)
            self.block_s += ALPHA * (self.block_s * scale - self.block_s)
