"""Graceful shutdown with vLLM's ``--shutdown-timeout`` semantics, on uvicorn.

On SIGTERM or SIGINT the server stops accepting (uvicorn closes its sockets and idle connections; a request that
still arrives on an open connection gets 503, and ``/health`` answers 503), lets the requests in flight finish for
up to the timeout, then aborts what is left: a stream ends with an error event and ``[DONE]``, a whole response
is a 503. A second signal does that at once and closes every connection. Either way the process then joins the
engine thread and exits 0, without a traceback.

uvicorn alone gets three things wrong here: it waits for open connections with no limit (a stream of 10,000
tokens holds it for minutes), it raises the signal again once it has stopped (an exit by SIGTERM, or a
KeyboardInterrupt traceback from the second Ctrl-C), and on a second Ctrl-C it cancels the handlers' tasks, whose
CancelledError it logs as "Exception in ASGI application" with a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
ABORT_GRACE_S = 1.0  # after the abort: time for the error events to go out before connections are closed
TASKS_GRACE_S = 1.0  # after connections are closed: time for their handlers to see it and return


class GracefulServer(uvicorn.Server):
    """``drain()`` runs on the first signal, ``abort()`` when ``timeout_s`` has passed or on a second signal."""

    def __init__(
        self, config: uvicorn.Config, drain: Callable[[], None], abort: Callable[[], None], timeout_s: float
    ) -> None:
        super().__init__(config)
        self.drain, self.abort, self.timeout_s = drain, abort, timeout_s
        self.deadline: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """The handlers run as event loop callbacks (uvicorn's ``signal.signal`` ones run between any two
        bytecodes), and the signal is not raised again once serving has stopped."""
        if threading.current_thread() is not threading.main_thread():
            yield  # a server in a thread (tests): whoever runs it stops it
            return
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:
            logger.info("%s again: aborting every request and closing every connection now", name)
            self.stop_now()
            return
        in_flight = len(self.server_state.tasks)
        logger.info(
            "%s: shutting down; %d requests in flight get %gs to finish (--shutdown-timeout), then are aborted; "
            "send it again to stop at once",
            name,
            in_flight,
            self.timeout_s,
        )
        self.should_exit = True
        self.drain()
        self.deadline = asyncio.get_running_loop().create_task(self._expire())

    def stop_now(self) -> None:
        self.should_exit = self.force_exit = True
        self.abort()
        for connection in list(self.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.close()  # its handler sees a disconnect and returns; nothing is cancelled under it

    async def _expire(self) -> None:
        await asyncio.sleep(self.timeout_s)
        if self.server_state.tasks:
            logger.info("--shutdown-timeout passed: aborting %d requests", len(self.server_state.tasks))
        self.abort()
        await asyncio.sleep(ABORT_GRACE_S)
        if self.server_state.connections:
            logger.info("closing %d connections that are still open", len(self.server_state.connections))
            self.stop_now()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().shutdown(sockets)
            if self.force_exit:
                # uvicorn returns without waiting for the handlers or the app's own shutdown: give the handlers a
                # moment to see their connection closed, and run the shutdown (it joins the engine thread), rather
                # than have the event loop cancel them as it closes (each cancellation is a logged traceback).
                for _ in range(int(TASKS_GRACE_S / 0.05)):
                    if not self.server_state.tasks:
                        break
                    await asyncio.sleep(0.05)
                await self.lifespan.shutdown()
        finally:
            if self.deadline is not None:
                self.deadline.cancel()
