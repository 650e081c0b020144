"""What rank 0 pays to send a step to a tensor-parallel worker over gloo's ``broadcast_object_list`` between two
local processes (how Ray tasks get them; local workers get a pipe): one decode step of 256 sequences as the
engine sends it (``SchedulerOutput.to_wire()``: lists of ints), and the same step's built input tensors for
comparison.

    python benchmarks/tp_broadcast.py
"""

from __future__ import annotations

import logging
import random
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from paged_backend.core.scheduler_output import ScheduledBatch, SchedulerOutput
from paged_backend.worker.step_inputs import build_step_inputs

logger = logging.getLogger("benchmarks.tp_broadcast")


def decode_step(num_seqs: int = 256, width: int = 80, block_size: int = 16) -> SchedulerOutput:
    """A decode step's shapes: W1's longest sequences span 80 blocks of 16 tokens."""
    rng = random.Random(0)
    lens = [rng.randint(1, width * block_size - 1) for _ in range(num_seqs)]
    batch = ScheduledBatch(
        input_token_ids=[rng.randrange(128256) for _ in range(num_seqs)],
        num_computed_tokens=lens,
        num_scheduled_tokens=[1] * num_seqs,
        block_tables=[[rng.randrange(2**16) for _ in range(n // block_size + 1)] for n in lens],
        sampling_rows=list(range(num_seqs)),
    )
    return SchedulerOutput(batch)


def _rank(rank: int, port: int, steps: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    step = decode_step()
    payloads = {
        "one step, SchedulerOutput.to_wire()": step.to_wire(),
        "one step, built input tensors": build_step_inputs(step.batch, 16),
    }
    for name, payload in payloads.items():
        box = [payload if rank == 0 else None]
        for _ in range(3):
            dist.broadcast_object_list(box, src=0)
        start = time.perf_counter()
        for _ in range(20):
            dist.broadcast_object_list(box, src=0)
        if rank == 0:
            logger.info("%-30s %6.2f ms", name, (time.perf_counter() - start) / 20 * 1e3)
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.spawn(_rank, args=(free_port, 8), nprocs=2)
