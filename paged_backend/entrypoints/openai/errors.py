"""OpenAI's error body, the exception a handler raises to answer with one, and the handlers that turn every
other failure (a body that does not validate, a routing error, a request the engine failed) into one.

Every error is ``{"error": {"message", "type", "param", "code"}}`` with ``param`` naming the offending field as
a dotted path (``messages.0.content``) whenever one field is to blame, so a client can point at it."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged_backend.engine.engine_loop import EngineDeadError, RequestFailedError

logger = logging.getLogger(__name__)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

# OpenAI's error types by status (``type`` of the body).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body; ``code`` repeats the HTTP status, ``param`` names the offending field or is null."""

    error: ErrorInfo


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body, which ``/v1/messages`` answers with (``anthropic_errors.py``)."""

    type: Literal["error"]
    error: AnthropicErrorInfo


class SafeJSONResponse(JSONResponse):
    """JSON whose encoding cannot fail on text: a lone UTF-16 surrogate (which an error message may echo from a
    request) becomes U+FFFD instead of a UnicodeEncodeError, so the answer is still the error, never a 500.
    Non-finite floats stay refused (``allow_nan=False``): they are not JSON, and logprobs are made finite
    before they get here."""

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))
        return _LONE_SURROGATE.sub("\ufffd", text).encode("utf-8")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def error_body(
    status: int, message: str, type_: str, param: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return SafeJSONResponse(body, status, headers=dict(headers) if headers else None)


def validation_error_body(exc: RequestValidationError) -> JSONResponse:
    """A 400 naming the field: the deepest of pydantic's errors (a union reports one error per member; the
    member that got furthest into the value is the one the client meant), ``param`` its path in the body."""
    errors = list(exc.errors())
    if not errors:
        return error_body(400, "invalid request body", "invalid_request_error")
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason, where = (first.get("ctx") or {}).get("error", ""), first.get("loc", ())[-1]
        text = f"the request body is not valid JSON: {reason} (at character {where})"
        return error_body(400, text, "invalid_request_error")
    located = [(_field_path(e.get("loc", ()), exc.body, e.get("type") == "missing"), e) for e in errors]
    depth = max(len(path) for path, _ in located)
    deepest = [(path, e) for path, e in located if len(path) == depth]
    path = deepest[0][0]
    if not path and not isinstance(exc.body, dict):
        return error_body(
            400,
            "the request body must be a JSON object, sent with Content-Type: application/json",
            "invalid_request_error",
        )
    messages = list(dict.fromkeys(_message(e) for p, e in deepest if p == path))
    param = ".".join(str(p) for p in path) or None
    text = " or ".join(messages)
    return error_body(400, f"{param}: {text}" if param else text, "invalid_request_error", param)


def _message(error: Mapping[str, Any]) -> str:
    if error.get("type") == "string_unicode":  # pydantic's word for an object key that is not text
        return "an object key is not Unicode text (it holds a lone UTF-16 surrogate)"
    return str(error.get("msg", "invalid value")).removeprefix("Value error, ")


def _field_path(loc: Sequence[Any], body: Any, missing: bool) -> list[str | int]:
    """``loc`` without its ``body`` root and without pydantic's union-member tags (``list[int]``,
    ``function-after[...]``): only the keys and indexes that lead through the body as sent (a missing field's
    own name ends the path)."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    path: list[str | int] = []
    value = body
    for i, part in enumerate(parts):
        if isinstance(value, dict) and isinstance(part, str) and part in value:
            path.append(part)
            value = value[part]
        elif isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            path.append(part)
            value = value[part]
        elif missing and i == len(parts) - 1 and isinstance(value, dict) and isinstance(part, str):
            path.append(part)
    return path


def install_error_handlers(app: FastAPI) -> None:
    """Every failure a request can meet, as an OpenAI error body."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        # A ValueError from SamplingParams or the engine that names its field (FieldError) becomes ``param``.
        param = exc.param if exc.param is not None else getattr(exc.__cause__, "field", None)
        return error_body(exc.status, exc.message, exc.type, param)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_body(503, str(exc), "service_unavailable")

    @app.exception_handler(RequestFailedError)
    async def request_failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        logger.warning("%s", exc)
        return error_body(500, str(exc), "internal_server_error")

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback and re-raises after sending this; the client gets OpenAI's shape, not
        # the text "Internal Server Error", and nothing of the server's internals.
        return error_body(500, "the server failed to handle this request (its log says why)", "internal_server_error")

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_body(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Keeps the exception's headers: a 405 must say which methods are allowed (``Allow``).
        type_ = ERROR_TYPES.get(exc.status_code, "invalid_request_error")
        return error_body(exc.status_code, str(exc.detail), type_, headers=exc.headers)
