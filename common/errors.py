"""OpenAI-style errors for every HTTP service: `{"error": {"message", "type", "param", "code"}}`
with the right status (the gateway and the planner answer alike). Whatever goes wrong — a body
that does not parse, an unknown route, a broker or store that is away, a bug — the client gets
this shape, never a bare `{"detail": ...}` or a plain-text 500."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error the client gets as an OpenAI error body; the message says what to change.
    `retry_after` (seconds) becomes a Retry-After header."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        retry_after: float | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, round(self.retry_after)))} if self.retry_after is not None else {}


class Unavailable(Exception):
    """A dependency (the broker, the store) cannot be reached now; the request may be retried."""


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def api_error_handler(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def validation_error_handler(_: Request, exc: RequestValidationError) -> JSONResponse:
    """pydantic's errors, reduced to the first one in words a person can act on."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        message = f"request body is not valid JSON: {first.get('msg')}"
    else:
        message = f"{param + ': ' if param else ''}{first.get('msg')}"
    return error_response(APIError(400, message, param=param, code=first.get("type")))


async def http_error_handler(_: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors: an unknown route (404), a wrong method (405), a body that is not
    even text (400)."""
    detail = exc.detail if isinstance(exc.detail, str) else "invalid request"
    if exc.status_code == 400:
        detail = f"request body could not be read: {detail}"
    return error_response(APIError(exc.status_code, detail))


async def unavailable_handler(_: Request, exc: Unavailable) -> JSONResponse:
    return error_response(APIError(503, f"{exc}; retry shortly", code="service_unavailable", retry_after=1))


async def unexpected_handler(request: Request, exc: Exception) -> JSONResponse:
    """A bug: logged with its traceback, answered as a 500 in the OpenAI shape."""
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(APIError(500, f"internal error ({type(exc).__name__}); it has been logged"))


def install_error_handlers(app: FastAPI) -> None:
    """Every error `app` can raise answers in the OpenAI shape."""
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(HTTPException, http_error_handler)
    app.add_exception_handler(Unavailable, unavailable_handler)
    app.add_exception_handler(Exception, unexpected_handler)
