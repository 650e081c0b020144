"""The data-parallel deployment's options, validated once (``--data-parallel-size`` and its companions)."""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_backend.distributed.router import RouterConfig
from paged_backend.field_checks import check_float, check_int


@dataclass(frozen=True)
class DataParallelConfig:
    """``data_parallel_size`` engine replicas as Ray actors, each with its own KV cache (and, with
    ``tensor_parallel_size`` > 1, its own workers), behind one router."""

    data_parallel_size: int = 2
    router: RouterConfig = field(default_factory=RouterConfig)  # its block_size is taken from the engine's
    max_restarts: int = 4  # times Ray restarts a replica whose process died; then it stays dead
    num_cpus_per_replica: float = 1.0  # Ray CPUs each replica reserves (its engine steps on them)
    num_gpus_per_replica: float | None = None  # None: tensor_parallel_size on a GPU engine, 0 on a CPU one
    probe_interval_s: float = 0.5  # how often each replica is asked whether it lives
    probe_timeout_s: float = 10.0  # a replica that answers no ping for this long counts as restarting

    def __post_init__(self) -> None:
        check_int("data_parallel_size", self.data_parallel_size, 1)
        check_int("max_restarts", self.max_restarts, 0)
        check_float("num_cpus_per_replica", self.num_cpus_per_replica, 0.0, 1024.0)
        check_float("num_gpus_per_replica", self.num_gpus_per_replica, 0.0, 64.0, allow_none=True)
        check_float("probe_interval_s", self.probe_interval_s, 0.0, 3600.0, low_open=True)
        check_float("probe_timeout_s", self.probe_timeout_s, 0.0, 3600.0, low_open=True)
