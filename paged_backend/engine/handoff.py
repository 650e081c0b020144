"""Handing a result from the engine loop's thread to whoever waits for it: a coroutine's future on its own event
loop (``post``, thread-safe), or a plain thread's ``concurrent.futures`` future (``settle``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any


def post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` on ``loop``; raises RuntimeError once that loop has closed."""
    loop.call_soon_threadsafe(fn, *args)


def settle(
    future: asyncio.Future[Any] | concurrent.futures.Future[Any], result: Any, error: BaseException | None
) -> None:
    """The future's result, or its exception; nothing for a future its caller has cancelled."""
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
