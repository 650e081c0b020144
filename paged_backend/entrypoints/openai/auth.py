"""The API key check, as ASGI middleware: it runs before routing and before the body is read, so a client
without the key learns nothing from the server but 401 (not which fields a body needs, nor which paths exist).

``Authorization: Bearer KEY``, the scheme in any case (RFC 9110), or ``x-api-key: KEY`` (Anthropic's clients), the
key compared in constant time. What stays
open without a key: ``/health`` (as in vLLM, for load balancers), ``/metrics`` (as in vLLM, for Prometheus
scrapers) and the API's own description (``/openapi.json``, ``/docs``, ``/redoc``: OpenAI's API is public).
Everything else, ``/v1/*`` and any path the server does not know, needs the key."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from paged_backend.entrypoints.openai.errors import error_body

OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of an ``Authorization: Bearer TOKEN`` header (any case of ``Bearer``), else None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip() or None


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_body(
            401,
            "invalid API key: send it as `Authorization: Bearer <key>` (or `x-api-key: <key>`)",
            "authentication_error",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)

    def authorized(self, scope: Scope) -> bool:
        values = [value for name, value in scope["headers"] if name == b"authorization"]
        token = bearer_token(values[0]) if len(values) == 1 else None  # two Authorization headers: ambiguous
        if token is None and not values:
            keys = [value.strip() for name, value in scope["headers"] if name == b"x-api-key"]
            token = keys[0] if len(keys) == 1 and keys[0] else None
        return token is not None and hmac.compare_digest(token, self.key)
