"""A deadline for each request's headers (``--header-read-timeout``).

uvicorn arms no timer on a new connection, and on a kept-alive one it stops its keep-alive timer at the first
byte that comes: a client that opens connections and sends their headers a byte at a time (slowloris) would hold
each of them, and a socket, for as long as it likes. Here a request's whole header block must arrive within the
deadline, counted from the connection's start or from the end of the previous response on it; past it the server
answers 408 with an OpenAI error body (if any of the request came) and closes the connection. The body has a
timeout of its own (``limits.py``); a handler's time is not limited.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

_MESSAGE = "the request's headers did not come within --header-read-timeout"
_BODY = json.dumps(
    {"error": {"message": _MESSAGE, "type": "invalid_request_error", "param": None, "code": 408}}
).encode()
_TIMED_OUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)


class _HeaderDeadline:
    """Mixed into uvicorn's HTTP protocol: both of uvicorn's protocols start a request's ``cycle`` once its headers
    are in, and mark it ``response_complete`` when its response has been sent, so "waiting for headers" is "no
    cycle, or the last one has ended"."""

    header_timeout_s: float
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any
    _deadline: asyncio.TimerHandle | None = None
    _received = False

    def _arm(self) -> None:
        self._disarm()
        self._received = False
        self._deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or bool(self.cycle.response_complete)

    def _expired(self) -> None:
        self._deadline = None
        if not self.transport.is_closing() and self._waiting_for_headers():
            if self._received:
                self.transport.write(_TIMED_OUT)
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def data_received(self, data: bytes) -> None:
        self._received = True
        super().data_received(data)  # type: ignore[misc]
        if not self._waiting_for_headers():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing() and self._waiting_for_headers():
            self._arm()  # the next request's headers (a pipelined one may have started a cycle already)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]


def http_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """The HTTP protocol uvicorn would pick itself (``httptools`` when installed, else ``h11``), held to
    ``header_timeout_s`` seconds for each request's headers."""
    base: type[asyncio.Protocol] = H11Protocol
    if importlib.util.find_spec("httptools") is not None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = HttpToolsProtocol
    return type(f"HeaderDeadline{base.__name__}", (_HeaderDeadline, base), {"header_timeout_s": header_timeout_s})
