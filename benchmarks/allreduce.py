"""All-reduce latency and bandwidth between the GPUs of this machine, at the message sizes tensor parallelism
sends: one decode row of a 70B shape (16 KB), a 256-row decode step of an 8B shape (2 MB) and an 8,192-token
prefill step (64 MB). Three implementations, each called eagerly and replayed inside a CUDA graph (as decode
steps run): NCCL through ``torch.distributed``, and PyTorch's symmetric-memory one-shot (every rank reads every
peer's buffer over NVLink and sums: one kernel, no multicast) and two-shot (reduce-scatter then all-gather).

    python benchmarks/allreduce.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paged_backend.distributed.all_reduce import symm_mem_all_reduce  # noqa: E402

logger = logging.getLogger("benchmarks.allreduce")
SIZES = {"16 KB (70B decode row)": 8192, "2 MB (8B decode, 256 rows)": 256 * 4096, "64 MB (8B prefill)": 8192 * 4096}
ITERS = 50


def _time_us(fn: Callable[[], Any], graph: bool) -> float:
    """Microseconds per call: ITERS calls back to back, eagerly or captured into one CUDA graph and replayed."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(ITERS):
                fn()
        g.replay()
        run = g.replay
    else:

        def run() -> None:
            for _ in range(ITERS):
                fn()

    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / ITERS


def _rank(rank: int, world_size: int, port: int, json_path: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, device_id=torch.device(rank)
    )
    group = dist.group.WORLD.group_name
    results: dict[str, dict[str, Any]] = {}
    symm_buffer = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_buffer = symm_mem.empty(max(SIZES.values()), dtype=torch.bfloat16, device=f"cuda:{rank}")
        symm_mem.rendezvous(symm_buffer, group)
    except Exception as exc:  # noqa: BLE001 - recorded; NCCL is still measured
        logger.warning("symmetric memory unavailable: %s", exc)
        results["symm_mem_error"] = {"error": f"{type(exc).__name__}: {exc}"}
    for name, numel in SIZES.items():
        x = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(x)
        methods: dict[str, Callable[[], Any]] = {"nccl": lambda x=x: dist.all_reduce(x)}
        if symm_buffer is not None:
            buf = symm_buffer[:numel]
            methods["symm_mem one-shot"] = lambda x=x, buf=buf, out=out: (
                torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf, x, "sum", group, out)
            )
            methods["symm_mem two-shot"] = lambda buf=buf: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group)
        row: dict[str, Any] = {}
        for method, fn in methods.items():
            for graph in (False, True):
                key = f"{method}{' (CUDA graph)' if graph else ''}"
                try:
                    us = _time_us(fn, graph)
                except Exception as exc:  # noqa: BLE001 - recorded, the others still run
                    row[key] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    continue
                row[key] = round(us, 1)
                if rank == 0:  # bus bandwidth as nccl-tests reports it: 2 (n - 1) / n of the bytes
                    bus = 2 * (world_size - 1) / world_size * numel * 2 / us / 1e3
                    logger.info("%-28s %-30s %8.1f us  %7.1f GB/s bus bandwidth", name, key, us, bus)
        if symm_buffer is not None:  # the one-shot result must be NCCL's
            x = torch.randn(numel, dtype=torch.bfloat16, device="cuda")  # the timed calls summed x into itself
            expected = x.clone()
            dist.all_reduce(expected)
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(symm_buffer[:numel], x, "sum", group, out)
            row["one_shot_max_abs_error_vs_nccl"] = float((out.float() - expected.float()).abs().max())
            # The engine's op (two-shot), replayed from a CUDA graph as decode steps run it: exactly NCCL's sum.
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                summed = symm_mem_all_reduce(x, symm_buffer, group)
            graph.replay()
            torch.cuda.synchronize()
            row["engine_two_shot_in_graph_equals_nccl"] = bool(torch.equal(summed, expected))
        results[name] = row
    if rank == 0 and json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="", help="write rank 0's table here")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        sys.exit(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    n = torch.cuda.device_count()
    mp.spawn(_rank, args=(n, 29500 + os.getpid() % 1000, args.json), nprocs=n)
