"""All-reduce latency and bandwidth between the GPUs of this machine (NCCL through torch.distributed), at the
message sizes tensor parallelism sends: one decode row of a 70B shape (16 KB), a 256-row decode step of an 8B
shape (2 MB) and an 8,192-token prefill step (64 MB).

    python benchmarks/allreduce.py
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

logger = logging.getLogger("benchmarks.allreduce")
SIZES = {"16 KB (70B decode row)": 8192, "2 MB (8B decode, 256 rows)": 256 * 4096, "64 MB (8B prefill)": 8192 * 4096}


def _rank(rank: int, world_size: int, port: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, device_id=torch.device(rank)
    )
    for name, numel in SIZES.items():
        x = torch.ones(numel, dtype=torch.bfloat16, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        iters = 50
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / iters
        if rank == 0:  # bus bandwidth as nccl-tests reports it: 2 (n - 1) / n of the bytes
            bus = 2 * (world_size - 1) / world_size * numel * 2 / seconds / 1e9
            logger.info("%-28s %8.1f us  %7.1f GB/s bus bandwidth", name, seconds * 1e6, bus)
    dist.destroy_process_group()


if __name__ == "__main__":
    n = torch.cuda.device_count()
    mp.spawn(_rank, args=(n, 29500 + os.getpid() % 1000), nprocs=n)
