"""The sum over ranks after each rowwise layer: NCCL (gloo on CPUs) through ``torch.distributed``, or on GPUs PyTorch's
symmetric-memory two-shot all-reduce.

A decode step sends two all-reduces a layer, each small: there NCCL's fixed cost dominates, and symmetric memory's
two-shot kernel (each rank sums its half of every peer's buffer, read over NVLink, then gathers the other half) is
several times faster inside a CUDA graph, and faster on large prefill tensors too (``benchmarks/allreduce.py``;
figures in docs/benchmarks.md). It needs buffers every rank has registered with the others (``symm_mem.empty`` +
``rendezvous``): the input is copied into one, and the sum lands in a fresh tensor. It uses no NVLink multicast.
vLLM's ``disable_custom_all_reduce=True`` keeps NCCL.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_ALIGN = 16  # bytes: each rank's share of a two-shot buffer starts aligned


@torch.library.custom_op("paged_backend::symm_mem_all_reduce", mutates_args=())
def symm_mem_all_reduce(x: torch.Tensor, buffer: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``group_name``, through the registered ``buffer`` (which must hold it:
    callers check). ``buffer`` is scratch, written here and read by no one else: declared unmutated, so that
    compiled graphs do not copy it around the call."""
    out = torch.empty_like(x)
    staged = buffer[: x.numel()]
    staged.copy_(x.reshape(-1))
    torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", group_name, out.view(-1))
    return out


@symm_mem_all_reduce.register_fake
def _(x: torch.Tensor, buffer: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


class TPAllReduce:
    """Called on each rowwise layer's output (a forward hook): sums it over the ranks, in place (NCCL, gloo) or
    into a returned tensor (symmetric memory). ``setup`` picks the implementation once the model exists; every
    rank calls it at the same point, since it is collective."""

    def __init__(self, use_custom: bool) -> None:
        self.use_custom = use_custom
        self.buffer: torch.Tensor | None = None  # [max_numel], registered on every rank
        self.group_name = ""
        self.handle: Any = None  # keeps the registration alive
        self.align = 1  # numel multiple: each rank's share of the buffer starts 16-byte aligned

    def setup(self, device: torch.device, dtype: torch.dtype, max_numel: int) -> None:
        """On GPUs, register a buffer for ``max_numel`` elements of ``dtype`` (one step's largest hidden states)
        and check the two-shot sum against NCCL's; keep NCCL where either fails on any rank."""
        if not self.use_custom or device.type != "cuda" or dist.get_world_size() < 2:
            return
        ok = 1
        try:
            import torch.distributed._symmetric_memory as symm_mem

            world = dist.group.WORLD
            if world is None:
                raise RuntimeError("no default process group")
            group_name = world.group_name
            buffer = symm_mem.empty(max_numel, dtype=dtype, device=device)
            self.handle = symm_mem.rendezvous(buffer, group_name)
            probe = torch.randn(min(4096, max_numel), dtype=dtype, device=device)
            expected = probe.clone()
            dist.all_reduce(expected)
            got = symm_mem_all_reduce(probe, buffer, group_name)
            ok = int(torch.equal(got, expected))
        except Exception as exc:  # noqa: BLE001 - NCCL still works; say why the faster path is off
            logger.warning("symmetric-memory all-reduce unavailable (%s: %s): using NCCL", type(exc).__name__, exc)
            ok = 0
        flag = torch.tensor([ok], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if int(flag.item()) == 1:
            self.buffer, self.group_name = buffer, group_name
            self.align = _ALIGN * dist.get_world_size() // buffer.element_size()
            logger.info("all-reduce: symmetric-memory two-shot for up to %d elements, NCCL beyond", max_numel)
        else:
            self.handle = None

    def close(self) -> None:
        """Drop the registered buffer before the process group goes (NCCL from then on, were anything to run)."""
        self.buffer, self.handle = None, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        buffer = self.buffer
        if (
            buffer is not None
            and x.dtype == buffer.dtype
            and x.is_contiguous()
            and x.numel() <= buffer.numel()
            and x.numel() % self.align == 0
        ):
            return symm_mem_all_reduce(x, buffer, self.group_name)
        dist.all_reduce(x)
        return None
