"""The server's data-parallel flags (vLLM's ``--data-parallel-size`` and ours beside it), checked at parse time:
N engine replicas on Ray behind the one front end (``entrypoints/data_parallel``)."""

from __future__ import annotations

import argparse

from paged_backend.distributed.router import ROUTING_POLICIES, RouterConfig
from paged_backend.entrypoints.data_parallel.config import DataParallelConfig


def add_data_parallel_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="N engine replicas as Ray actors behind this server, each with its own KV cache and "
        "--tensor-parallel-size GPUs (default 1: one engine in this process)",
    )
    parser.add_argument(
        "--data-parallel-routing",
        default="prefix",
        choices=list(ROUTING_POLICIES),
        help="prefix: a request goes to the replica that most likely caches its prompt's first blocks, unless that "
        "one is busier than the least loaded by more than --data-parallel-max-load-imbalance; round_robin: each in "
        "turn (default prefix)",
    )
    parser.add_argument(
        "--data-parallel-max-load-imbalance",
        type=int,
        default=RouterConfig.max_load_imbalance,
        metavar="REQUESTS",
        help="requests in flight a replica may have beyond the least loaded one and still get a request for "
        f"its cached prefix (default {RouterConfig.max_load_imbalance})",
    )
    parser.add_argument(
        "--data-parallel-max-restarts",
        type=int,
        default=DataParallelConfig.max_restarts,
        metavar="N",
        help=f"times Ray restarts a replica whose process died (default {DataParallelConfig.max_restarts})",
    )


def data_parallel_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> DataParallelConfig | None:
    """The data-parallel options, checked now (a bad value names its flag); None for one engine."""
    flags = {
        "data_parallel_size": "--data-parallel-size",
        "max_restarts": "--data-parallel-max-restarts",
        "max_load_imbalance": "--data-parallel-max-load-imbalance",
    }
    try:
        imbalance = args.data_parallel_max_load_imbalance
        router = RouterConfig(policy=args.data_parallel_routing, max_load_imbalance=imbalance)
        config = DataParallelConfig(args.data_parallel_size, router, max_restarts=args.data_parallel_max_restarts)
    except ValueError as exc:
        parser.error(f"{flags.get(str(getattr(exc, 'field', '')), '--data-parallel-size')}: {exc}")
    return config if config.data_parallel_size > 1 else None
