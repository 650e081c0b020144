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


ROW_BLOCK_MAX = 4096  # columns a one-program-a-row kernel loads at once; longer rows loop over chunks of this many


def as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` [..., K] as [rows, K] with unit column stride (copied only where it has not), and the chunk width a
    one-program-a-row kernel loads: the row's length rounded up to a power of two, at most ``ROW_BLOCK_MAX``."""
    n_cols = x.shape[-1]
    flat = x.reshape(-1, n_cols)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat, min(1 << max(n_cols - 1, 0).bit_length(), ROW_BLOCK_MAX)
