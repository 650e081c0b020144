"""Data parallelism: engine replicas as Ray actors behind one prefix-aware router (``DataParallelLLM``; the
server's ``--data-parallel-size``). Ray loads only when replicas start."""

from paged_backend.entrypoints.data_parallel.config import DataParallelConfig
from paged_backend.entrypoints.data_parallel.llm import DataParallelLLM

__all__ = ["DataParallelConfig", "DataParallelLLM"]
