"""Why the service could not serve a request. Each error carries its HTTP status; every front door
answers with that status and shapes the body in its own protocol's format."""

from __future__ import annotations


class ServiceError(RuntimeError):
    """A request the cluster could not serve."""

    status = 500


class TooManyRequests(ServiceError):
    """``max_requests`` are in flight."""

    status = 429


class RequestTimeout(ServiceError):
    """A timeout expired; the message names which (e.g. ``Request inference timeout``)."""

    status = 408


class NoWorkerError(ServiceError):
    """No (prefill, decode) pair can take a request now, or the coordinator is shutting down."""

    status = 503


class GenerationFailed(ServiceError):
    """The cluster could not finish the request (after retries)."""

    status = 500


class ConstraintViolated(GenerationFailed):
    """The request's output cannot follow its constraint: its grammar outgrew the parser's limits
    or its mask budget, or a token it was given does not match. Deterministic: never retried."""

    status = 422


def check_room(draining: bool, count: int, max_requests: int, what: str) -> None:
    """Raise why one more request cannot be taken: the coordinator drains (NoWorkerError), or
    ``count`` requests ``what`` (in flight, open) reached ``max_requests`` (TooManyRequests)."""
    if draining:
        raise NoWorkerError("the coordinator is shutting down")
    if count >= max_requests:
        raise TooManyRequests(f"{count} requests {what} (max_requests {max_requests})")
