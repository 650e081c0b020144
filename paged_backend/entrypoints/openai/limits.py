"""The request-body cap (``--max-request-body-mb``): a body over it is a 413 OpenAI error, refused before it is read
when its ``Content-Length`` says so, else as soon as the bytes received pass the cap (a chunked body), so one
request can never make the server hold more than the cap (plus one network chunk) of it in memory. A body whose
next bytes do not come within ``--body-read-timeout`` is a 408, so a stalling client holds no handler for long."""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from paged_backend.entrypoints.openai.errors import error_body

MIB = 1 << 20


class RequestBodyLimit:
    """Pure ASGI middleware (Starlette's ``BaseHTTPMiddleware`` would buffer streamed responses and hide client
    disconnects from the handlers)."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s  # the longest wait for the body's next bytes (a client that stalls)

    def message(self, size: str) -> str:
        return f"the request body ({size}) is larger than --max-request-body-mb allows ({self.max_bytes} bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            # Answered without reading the body; the connection closes, so its unread bytes are never parsed.
            response = error_body(413, self.message(f"{int(declared)} bytes"), "invalid_request_error")
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        received, whole = 0, False

        async def counting_receive() -> Message:
            nonlocal received, whole
            if whole:  # after the body: only the disconnect is left, which may come at any time
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except asyncio.TimeoutError:
                raise HTTPException(
                    408, f"the request body stalled: no bytes for {self.read_timeout_s:g} s (--body-read-timeout)"
                ) from None
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI passes an HTTPException raised while it reads the body on to the app's handler,
                    # which answers with an OpenAI error body of this status.
                    raise HTTPException(413, self.message(f"more than {self.max_bytes} bytes"))
            return message

        await self.app(scope, counting_receive, send)
