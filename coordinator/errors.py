"""Why the service could not serve a request. Each error carries its HTTP status; every front door
answers with that status and shapes the body in its own protocol's format.

An error the client may simply retry carries ``retry_after_s`` (whole seconds), which every door
sends as ``Retry-After``. A refusal's message speaks of the client's own request or key only: it
never tells one client how busy the pool is or what its limits are (that is other tenants'
traffic)."""

from __future__ import annotations

import math

RETRY_BUSY_S = 1  # Retry-After of a refusal at a full pool
RETRY_UNAVAILABLE_S = 5  # Retry-After of a 503 while the coordinator starts or drains
MAX_RETRY_AFTER_S = 600  # the longest Retry-After a decode worker's estimate gives


def retry_after(expected_s: float) -> int | None:
    """``Retry-After`` (whole seconds) of a refusal at a full pool whose decode worker expected
    room in ``expected_s`` (0: no estimate; None: ``TooManyRequests``' own)."""
    if expected_s <= 0:
        return None
    return min(max(math.ceil(expected_s), RETRY_BUSY_S), MAX_RETRY_AFTER_S)


class ServiceError(RuntimeError):
    """A request the cluster could not serve; ``retry_after_s``: when a retry may succeed."""

    status = 500
    retry_after_s: int | None = None

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s


class TooManyRequests(ServiceError):
    """No room for the request now (the pool's, or its key's own limit)."""

    status = 429
    retry_after_s: int | None = RETRY_BUSY_S


class RequestTimeout(ServiceError):
    """A timeout expired; the message names which (e.g. ``Request inference timeout``)."""

    status = 408


class NoWorkerError(ServiceError):
    """No (prefill, decode) pair can take a request now, or the coordinator is shutting down."""

    status = 503


class StoreUnavailable(ServiceError):
    """A shared pool's response store cannot be reached now (``/v1/responses``)."""

    status = 503
    retry_after_s: int | None = 1


class GenerationFailed(ServiceError):
    """The cluster could not finish the request (after retries)."""

    status = 500


class ConstraintViolated(GenerationFailed):
    """The request's output cannot follow its constraint: its grammar outgrew the parser's limits
    or its mask budget, or a token it was given does not match. Deterministic: never retried."""

    status = 422


def check_room(draining: bool, count: int, max_requests: int, what: str) -> None:
    """Raise why one more request cannot be taken: the coordinator drains (NoWorkerError), or
    ``count`` requests ``what`` (in flight, open) reached ``max_requests`` (TooManyRequests, whose
    message names neither: the pool's load is no client's business)."""
    if draining:
        raise NoWorkerError("the coordinator is shutting down", RETRY_UNAVAILABLE_S)
    if count >= max_requests:
        raise TooManyRequests("the server is busy; retry later")
