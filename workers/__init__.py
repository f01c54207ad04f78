"""What every worker actor is made of: the contracts that cross Ray (``contracts``), the engine
on its own thread (``runtime``) with one record per request (``worker_request``), what both
hand-off roles share (``handoff_worker``), the colocated worker of the ``single_node`` mode
(``colocated``) and the embedding worker (``embedding``). The prefill and decode roles live
beside this package, in ``prefill_worker/`` and ``decode_worker/``; no module here imports
them."""
