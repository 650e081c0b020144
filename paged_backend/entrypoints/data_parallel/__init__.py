"""Data parallelism: engine replicas as Ray actors behind one prefix-aware router (``DataParallelLLM``; the
server's ``--data-parallel-size``). Importing this is light: torch loads with the first replica's engine, Ray when
the replicas start."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from paged_backend.entrypoints.data_parallel.config import DataParallelConfig

if TYPE_CHECKING:
    from paged_backend.entrypoints.data_parallel.llm import DataParallelLLM

__all__ = ["DataParallelConfig", "DataParallelLLM"]


def __getattr__(name: str) -> Any:
    if name == "DataParallelLLM":
        from paged_backend.entrypoints.data_parallel.llm import DataParallelLLM

        return DataParallelLLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
