"""The OpenAPI schema, true to what the server answers: every error status it can send with OpenAI's error
body (no FastAPI 422: validation errors are 400s), the streaming endpoints' ``text/event-stream`` events,
``/metrics`` as Prometheus text, the bearer key where one is required, and the bounds that depend on the loaded
model (token ids below the vocabulary size, ``max_tokens`` below ``max_model_len``, ``n`` and ``best_of`` within
``max_num_seqs``), which no static model can state."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from paged_backend.entrypoints.openai.auth import OPEN_PATHS
from paged_backend.entrypoints.openai.errors import AnthropicErrorResponse, ErrorResponse
from paged_backend.entrypoints.openai.protocol import MAX_N
from paged_backend.entrypoints.openai.responses import (
    AnthropicEvent,
    ChatCompletionChunk,
    CompletionChunk,
    ResponseEvent,
)

_REF = "#/components/schemas/{model}"
ERROR_DESCRIPTIONS = {
    400: "An invalid field (`param` names it), or a prompt too long for `max_model_len`",
    404: "No model of that name is served",
    413: "The request body is too large",
    429: "Too many requests are already waiting (`--max-waiting-requests`)",
    500: "The engine failed this request (the server goes on serving others)",
    503: "The engine has stopped",
}
UNAUTHORIZED = {
    "description": "No valid API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`)",
    "headers": {"WWW-Authenticate": {"required": True, "schema": {"type": "string", "const": "Bearer"}}},
    "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}},
}
UNAUTHORIZED_ANTHROPIC = {
    **UNAUTHORIZED,
    "content": {"application/json": {"schema": {"$ref": _REF.format(model="AnthropicErrorResponse")}}},
}


ANTHROPIC_PATHS = frozenset({"/v1/messages"})  # their errors are Anthropic's body, 401 included


def error_responses(*statuses: int, model: type[BaseModel] = ErrorResponse) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a route: OpenAI's error body (or ``model``) at each status (401 is added where a key is
    required)."""
    return {status: {"model": model, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}


def streamed(
    whole: type[BaseModel], chunk: type[BaseModel], error: type[BaseModel] = ErrorResponse
) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a generating endpoint: ``whole`` as JSON, or with ``stream: true`` a server-sent event
    stream whose events' ``data`` are ``chunk``s (or an error body, when the engine fails midway), then
    ``[DONE]``; and every error a request body can meet."""
    data = {
        "type": "string",
        "anyOf": [
            {"const": "[DONE]"},
            {
                "not": {"const": "[DONE]"},
                "contentMediaType": "application/json",
                "contentSchema": {
                    "anyOf": [{"$ref": _REF.format(model=chunk.__name__)}, {"$ref": _REF.format(model=error.__name__)}]
                },
            },
        ],
    }
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    ok = {"model": whole, "description": "The whole response, or its event stream", "content": {}}
    ok["content"] = {"text/event-stream": {"schema": event}}
    return {200: ok, **error_responses(400, 404, 413, 429, 500, 503, model=error)}


PROMETHEUS: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
}


@dataclass(frozen=True)
class ModelLimits:
    """The bounds a request must keep that come from the loaded model and the engine's configuration."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int


def install_openapi(app: FastAPI, limits: ModelLimits, secured: bool) -> None:
    """Serve the corrected schema at ``/openapi.json`` (built once, on first request, as FastAPI does)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            app.openapi_schema = fix_schema(schema, limits, secured)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def fix_schema(schema: dict[str, Any], limits: ModelLimits, secured: bool) -> dict[str, Any]:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    _, defs = models_json_schema(
        [
            (m, "serialization")
            for m in (CompletionChunk, ChatCompletionChunk, ResponseEvent, AnthropicEvent)
            + (ErrorResponse, AnthropicErrorResponse)
        ],
        ref_template=_REF,
    )
    components.update(defs.get("$defs", {}))
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path, operation in _operations(schema):
        operation.get("responses", {}).pop("422", None)
        if secured and path not in OPEN_PATHS:
            operation["security"] = [{"APIKey": []}]
            anthropic = path in ANTHROPIC_PATHS
            operation["responses"]["401"] = UNAUTHORIZED_ANTHROPIC if anthropic else UNAUTHORIZED
    if secured:
        schemes = schema["components"].setdefault("securitySchemes", {})
        schemes["APIKey"] = {"type": "http", "scheme": "bearer", "description": "the server's --api-key"}
    _bound_requests(components, limits)
    return schema


def _operations(schema: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for path, item in schema.get("paths", {}).items():
        for operation in item.values():
            yield path, operation


def _bound_requests(components: dict[str, Any], limits: ModelLimits) -> None:
    """The model's bounds on the request bodies' fields (the engine enforces each of them, as a 400)."""
    last_token = limits.vocab_size - 1
    longest_output = limits.max_model_len - 1  # a prompt has at least one token
    samples = min(MAX_N, limits.max_num_seqs)
    for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest", "MessagesRequest"):
        properties = components.get(name, {}).get("properties", {})
        bounds: dict[str, Callable[[dict[str, Any]], None]] = {
            "max_tokens": _maximum(longest_output),
            "max_completion_tokens": _maximum(longest_output),
            "max_output_tokens": _maximum(longest_output),
            "min_tokens": _maximum(longest_output),
            "n": _maximum(samples),
            "best_of": _maximum(samples),
            "stop_token_ids": _items(_maximum(last_token)),
            "prompt": _items(_maximum(last_token), _items(_maximum(last_token))),
        }
        for field, bound in bounds.items():
            if field in properties:
                bound(properties[field])


def _branches(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """``schema`` and the alternatives of its ``anyOf`` / ``oneOf``."""
    return [schema, *schema.get("anyOf", []), *schema.get("oneOf", [])]


def _maximum(value: int) -> Callable[[dict[str, Any]], None]:
    def bound(schema: dict[str, Any]) -> None:
        for branch in _branches(schema):
            if branch.get("type") == "integer":
                branch["maximum"] = min(branch.get("maximum", value), value)

    return bound


def _items(*bounds: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    """Apply ``bounds`` to the items of every array branch (integer bounds reach integer items, nested
    ``_items`` reach arrays of arrays)."""

    def bound(schema: dict[str, Any]) -> None:
        for branch in _branches(schema):
            if branch.get("type") == "array" and isinstance(branch.get("items"), dict):
                for inner in bounds:
                    inner(branch["items"])

    return bound
