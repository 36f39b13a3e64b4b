"""OpenAI-style errors for every HTTP service: `{"error": {"message", "type", "param", "code"}}`
with the right status (the gateway and the planner answer alike). Whatever goes wrong — a body
that does not parse, an unknown route, a broker or store that is away, a bug — the client gets
this shape, never a bare `{"detail": ...}` or a plain-text 500."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)
MAX_MESSAGE = 500  # characters: an error says what to change; it never carries the input back
MAX_PARAM = 120

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
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        # Capped here whatever the caller quoted: a 10 MB field must not come back as a 10 MB error.
        message, param = clip(message, MAX_MESSAGE), None if param is None else clip(param, MAX_PARAM)
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, round(self.retry_after)))} if self.retry_after is not None else {}


def clip(text: str, limit: int = 80) -> str:
    """`text` as an error may quote it: at most about `limit` characters, the cut said."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text):,} characters in all)"


class Unavailable(Exception):
    """A dependency (the broker, the store) cannot be reached now; the request may be retried."""


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def api_error_handler(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def validation_error_handler(_: Request, exc: RequestValidationError) -> JSONResponse:
    """pydantic's errors, reduced to one in words a person can act on (`explain`)."""
    return error_response(explain(exc.errors(), exc.body))


def explain(errors: Sequence[Any], body: Any = None) -> APIError:
    """The 400 for a request that did not validate: the error on the deepest field (a union's
    members each report one; the deepest is where the input went wrong), its path as `param`, and
    its real reason — a value of the wrong JSON type says which type it must be and which it is, a
    body that is not JSON says where. The input itself is never quoted back (it may be megabytes)."""
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, _json_message(first, body), code="json_invalid")
    located = [(_field_path(e), e) for e in errors]
    depth = max(len(path) for path, _ in located)
    deepest = [(path, e) for path, e in located if len(path) == depth]
    path, chosen = deepest[0]
    param = ".".join(path) or (chosen.get("ctx") or {}).get("param")
    here = [e for p, e in deepest if p == path]
    reasons = _type_reason(here) or "; or ".join(dict.fromkeys(_reason(e) for e in here))
    return APIError(400, f"{param + ': ' if param else ''}{reasons}", param=param, code=chosen.get("type"))


def _field_path(error: Any) -> list[str]:
    """The error's location as the client's field names: without "body", and without the labels
    pydantic puts in for a union's members (`str`, `list[...]`, a tagged union, and the tag it
    adds after the list index). A key the client made up is cut short."""
    path: list[str] = []
    tags = 0
    for part in error.get("loc", ()):
        if isinstance(part, str) and (part in _MEMBER_LABELS or "[" in part):
            tags += part.count("tagged-union[")
        elif isinstance(part, str) and tags:
            tags -= 1
        else:
            path.append(clip(str(part), 40))
    return path[1:] if path[:1] == ["body"] else path


_MEMBER_LABELS = {"str", "int", "float", "bool", "none", "dict", "list"}
# pydantic's type errors, as the JSON type the field takes.
_EXPECTED = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "bool_type": "true or false",
    "bool_parsing": "true or false", "string_type": "a string", "list_type": "an array",
    "tuple_type": "an array", "dict_type": "an object", "model_type": "an object",
    "model_attributes_type": "an object", "none_required": "null",
}  # fmt: skip


def _type_reason(errors: list[Any]) -> str | None:
    """ "must be an integer, not a string" when every error here is of a wrong JSON type (a union's
    members each name the type they take); None otherwise."""
    if not all(e.get("type") in _EXPECTED and "input" in e for e in errors):
        return None
    wanted = list(dict.fromkeys(_EXPECTED[e["type"]] for e in errors))
    options = wanted[0] if len(wanted) == 1 else f"{', '.join(wanted[:-1])} or {wanted[-1]}"
    given = errors[0]["input"]
    if given is None:
        return f"is null; it must be {options}"
    return f"must be {options}, not {json_kind(given)}"


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in words (a short scalar shown): `a boolean (true)`."""
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int):
        return "an integer" if abs(value) >= 10**20 else f"an integer ({value})"
    if isinstance(value, float):
        return f"a decimal number ({clip(repr(value), 20)})"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), "another type")


def _reason(error: Any) -> str:
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    if error.get("input", ...) is None and error.get("type") != "missing":
        return f"is null; {message[0].lower()}{message[1:]}"
    return message


def _json_message(error: Any, body: Any) -> str:
    reason = (error.get("ctx") or {}).get("error") or error.get("msg")
    pos = error["loc"][-1] if error.get("loc") else None
    if isinstance(body, str) and isinstance(pos, int):
        line = body.count("\n", 0, pos) + 1
        column = pos - (body.rfind("\n", 0, pos) + 1) + 1
        return f"request body is not valid JSON: {reason} at line {line}, column {column} (char {pos})"
    return f"request body is not valid JSON: {reason}"


async def http_error_handler(_: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors: an unknown route (404), a wrong method (405), a body that is not
    even JSON text (400: `unreadable_body` says why)."""
    detail = exc.detail if isinstance(exc.detail, str) else "invalid request"
    if exc.status_code == 400:
        return error_response(APIError(400, unreadable_body(exc.__cause__, detail), code="json_invalid"))
    return error_response(APIError(exc.status_code, detail))


def unreadable_body(cause: BaseException | None, detail: str) -> str:
    """Why a body that FastAPI could not parse (it says only "There was an error parsing the
    body") was refused, from the error underneath, in words a client can act on."""
    if isinstance(cause, UnicodeDecodeError):
        byte = cause.object[cause.start]
        return f"request body is not valid UTF-8: byte 0x{byte:02x} at position {cause.start}"
    if isinstance(cause, RecursionError):
        return "request body nests its arrays and objects too deeply to be read"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        # Python refuses to read integers of over 4,300 digits (a guard against slow parsing).
        return "request body holds an integer with more than 4,300 digits, which no field takes"
    return f"request body could not be read: {detail}"


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
