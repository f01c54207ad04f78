"""The errors of the front doors, in one place: each is answered with an error status before the
answer began, in its door's body (``coordinator/api/app.py`` maps them)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from coordinator.errors import ServiceError


class APIError(Exception):
    """A request answered with an error status before its answer began. ``code`` names the
    failure where it has a name of its own (a service error's class, ``content_filter``);
    ``retry_after_s``: sent as ``Retry-After``."""

    def __init__(
        self, status: int, message: str, code: str | None = None, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.retry_after_s = retry_after_s

    @classmethod
    def from_service(cls, exc: ServiceError) -> APIError:
        """A service error, answered with the HTTP status (and ``Retry-After``) it carries."""
        return cls(exc.status, str(exc), type(exc).__name__, exc.retry_after_s)


def retry_headers(error: APIError) -> dict[str, str]:
    """``Retry-After`` (whole seconds) when ``error`` may be retried, else nothing."""
    return {} if error.retry_after_s is None else {"Retry-After": str(error.retry_after_s)}


class BadRequestError(APIError):
    """The body is not a JSON object of the expected shape: HTTP 400."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message)


class InputValidationError(APIError):
    """A client's parameter is invalid: HTTP 422, ``error_type: Input Validation Error``."""

    def __init__(self, message: str) -> None:
        super().__init__(422, message)


class FormatError(Exception):
    """A structured-output field refused: ``param`` names it."""

    def __init__(self, param: str, message: str, value: Any = None, unsupported: bool = False):
        super().__init__(message)
        self.param, self.message, self.value, self.unsupported = param, message, value, unsupported


class OpenAIError(APIError):
    """An error answered with OpenAI's body; ``kind`` is its ``type``, ``param`` the field."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(status, message, code, retry_after_s)
        self.param, self.kind = param, kind

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status, headers=retry_headers(self))


class AzureError(APIError):
    """An error with a body of the API's own (and maybe headers)."""

    def __init__(self, status: int, body: dict[str, Any], headers: dict | None = None) -> None:
        super().__init__(status, json.dumps(body))
        self.body, self.headers = body, headers or {}


class MlflowError(APIError):
    """Answered 400 (or ``status``) with MLflow's body ``{"error_code", "message"}``."""

    def __init__(
        self,
        message: str,
        code: str = "BAD_REQUEST",
        status: int = 400,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(status, message, code, retry_after_s)

    def body(self) -> dict[str, str]:
        return {"error_code": str(self.code), "message": self.message}
