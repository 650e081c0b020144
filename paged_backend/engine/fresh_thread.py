"""Building an engine on a thread of its own (for an engine only the engine loop will step)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")


def call_in_fresh_thread(fn: Callable[[], _T]) -> _T:
    """``fn()`` on a thread that ends when it returns (its result or exception comes back here).

    For building an engine that only the engine loop will step, on CPU: OpenMP's thread team belongs to the thread
    that first computes, for that thread's life. Loading the model on the caller's thread leaves a team there; the
    loop thread's own team then makes more OpenMP threads than cores, and libgomp parks its threads after every
    parallel region instead of spinning, so each of a step's many small ops pays a wake-up. A thread that ends
    takes its team with it, and the loop's team is then the only one."""
    result: list[_T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name="paged-backend-load", daemon=True)  # Ctrl-C need not wait
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
