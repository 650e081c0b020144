"""What rank 0 pays to send a step's inputs to a tensor-parallel worker over gloo's ``broadcast_object_list``
between two local processes (how Ray tasks get them; local workers get a pipe, and a multi-step round as its first
step only): one decode step and one multi-step round of 256 sequences, as numpy arrays (``StepInputs.to_wire``)
and, for comparison, as torch tensors.

    python benchmarks/tp_broadcast.py
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paged_backend.worker.step_inputs import StepInputs

logger = logging.getLogger("benchmarks.tp_broadcast")


def decode_inputs(num_seqs: int = 256, width: int = 80) -> StepInputs:
    """A decode step's shapes: W1's longest sequences span 80 blocks of 16 tokens."""
    return StepInputs(
        input_ids=torch.randint(0, 128256, (num_seqs,)),
        positions=torch.randint(0, 1280, (num_seqs,)),
        slot_mapping=torch.randint(0, 2**20, (num_seqs,)),
        block_tables=torch.randint(0, 2**16, (num_seqs, width), dtype=torch.int32),
        cu_seqlens_q=torch.arange(num_seqs + 1, dtype=torch.int32),
        context_lens=torch.randint(1, 1280, (num_seqs,)),
        logits_indices=torch.arange(num_seqs),
        sample_seqs=[],
    )


def _rank(rank: int, port: int, steps: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rounds = [decode_inputs() for _ in range(steps)]  # each step's own tensors, as advance_decode_inputs makes
    payloads = {
        "one step, numpy": rounds[0].to_wire(),
        f"{steps}-step round, numpy": [step.to_wire() for step in rounds],
        "one step, torch tensors": rounds[0],
        f"{steps}-step round, torch tensors": rounds,
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
