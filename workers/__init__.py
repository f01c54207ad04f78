"""What every worker actor is made of: the contracts that cross Ray (``contracts``), the engine
on its own thread with per-request event streams (``runtime``), and the colocated worker of the
``single_node`` mode (``colocated``). The prefill and decode roles live in ``prefill_worker/``
and ``decode_worker/``."""
