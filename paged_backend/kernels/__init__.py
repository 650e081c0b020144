"""Kernels, each with a torch reference twin that runs anywhere. Triton is imported here once: without it (it
ships with Linux torch) the twins run."""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device: launch heuristics aim for a few programs per SM."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
