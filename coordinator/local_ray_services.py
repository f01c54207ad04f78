"""Which of Ray's own services a local Ray started by the coordinator runs.

A head node's ``ray.init`` starts, besides ``gcs_server`` and the ``raylet``, the dashboard (its
HTTP server, which job submission and Serve's REST API go through), the dashboard agent and the
runtime-env agent (the raylet needs both: metrics, logs, and the workers' ``runtime_env``), the
autoscaler's monitor and the log monitor. Two of these serve nothing pdserve uses on a Ray of its
own: the autoscaler's monitor (a local Ray has its cores from the start and never grows; only
``ray status`` reads what it writes) and the log monitor (it streams workers' output to drivers
that ask for it, and the coordinator connects with ``log_to_driver=False``; workers still write
their logs into the session folder themselves). Together they hold about 95 MiB (PSS, measured
by ``benchmarks/serving/memory.py``). ``ray.init`` has no argument for them, so they are turned
off on the node's parameters while ``ray.init`` builds them; a Ray whose parameters lack either
name starts them as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# RayParams field -> the value that leaves the service out
UNUSED_SERVICES = {"no_monitor": True, "include_log_monitor": False}


@contextlib.contextmanager
def without_unused_services() -> Iterator[None]:
    """Within: a head node started here runs no autoscaler monitor and no log monitor."""
    from ray._private import parameter

    params = parameter.RayParams
    original = params.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        for name, value in UNUSED_SERVICES.items():
            if hasattr(self, name):
                setattr(self, name, value)

    params.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        params.__init__ = original  # type: ignore[method-assign]
