"""The last program to arrive merges the parts: split kernels (AWQ's split-K, attention's split context, greedy's
split vocabulary) each write fp32 parts, and instead of a second kernel adding them, the last program of each
output tile to finish does it. A second kernel costs its own launch and drain, which at decode sizes, where the
split kernel itself runs for microseconds and runs once per linear of every layer, is a sizeable share of a step.

Each tile counts its arrivals in a per-device int32 counter; the last arrival resets it to zero, so the counters
are zero between kernels and one buffer serves every kernel of the device. Kernels of one device must therefore
not run concurrently on two streams (the engine runs one stream per device).
"""

from __future__ import annotations

import functools

import torch

from paged_backend.kernels import tl, triton

# Counters per device: more output tiles than any split launch of ours has.
MAX_TILES = 1 << 16


def split_k_parts(tiles: int, k: int, min_part: int, programs: int) -> int:
    """Parts (a power of two, 16 at most) to cut K into so that about ``programs`` programs run for ``tiles``
    output tiles, no part shorter than ``min_part``: with the last program adding the parts, a deeper split costs
    little, and decode's few tiles would otherwise leave most SMs idle."""
    split_k = 1
    while tiles * split_k < programs and split_k < 16 and k // (split_k * 2) >= min_part:
        split_k *= 2
    return split_k


def arrival_counters(device: torch.device, tiles: int = 0) -> torch.Tensor:
    """The device's zeroed tile counters, ``[MAX_TILES]`` int32, for a launch of ``tiles`` output tiles. Made on
    first use, which is before any CUDA graph capture (the engine's warm-up runs every kernel eagerly first), so
    it is ordinary memory that outlives graphs. ``cuda`` and ``cuda:0`` (when current) are one device, with one
    buffer."""
    if tiles > MAX_TILES:
        raise ValueError(f"a split launch has {tiles} output tiles; at most MAX_TILES={MAX_TILES} have counters")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _counters(device)


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


if triton is not None:

    @triton.jit
    def last_to_arrive(counter_ptr, arrivals):
        """True in the last of ``arrivals`` programs to call this with ``counter_ptr``, after every one of them
        has stored its part. The barrier orders this program's stores (all its threads) before the release; the
        acquire orders the last program's loads after every other's stores (read them with ``.cg``: around L1)."""
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        last = arrived == arrivals - 1
        if last:
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")  # zero for the next kernel
        return last

    @triton.jit
    def add_parts(
        partial_ptr,  # [parts, M, N] fp32
        offs_m,  # [BM]
        offs_n,  # [BN]
        mask,  # [BM, BN]
        M,
        N,
        parts,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """The tile's parts added in order (the same sum whichever program is last): ``[BM, BN]`` fp32."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        tile = offs_m[:, None] * N + offs_n[None, :]
        for part in range(0, parts):
            acc += tl.load(partial_ptr + part * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
        return acc
