"""Fault injection, for chaos tests only: with ``PDSERVE_FAULT_INJECTION=1`` in its environment the
coordinator serves ``POST /v1/faults`` and passes the variable on to the workers it starts, and a
decode worker then accepts ``inject_fault``; without it both refuse."""

from __future__ import annotations

import os

FAULT_INJECTION_ENV = "PDSERVE_FAULT_INJECTION"


def fault_injection_enabled() -> bool:
    return os.environ.get(FAULT_INJECTION_ENV) == "1"
