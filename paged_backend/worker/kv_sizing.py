"""How many KV blocks the cache gets, on the device and in CPU swap space."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from paged_backend.config import EngineConfig
from paged_backend.worker.cache_engine import KVCacheSpec

logger = logging.getLogger(__name__)


def num_gpu_blocks(config: EngineConfig, spec: KVCacheSpec, device: torch.device, profile: Callable[[int], int]) -> int:
    """Device blocks: ``num_kv_blocks`` when given; else what fits — on a GPU what ``profile(block_bytes)`` finds
    in ``gpu_memory_utilization``, elsewhere ``kv_cache_memory_gib`` — but never more than ``max_num_seqs``
    full-length sequences could use (a small model on a large GPU would otherwise zero gigabytes it never reads,
    and take seconds doing it). Raises when one sequence of ``max_model_len`` would not fit."""
    cache = config.cache_config
    block_size = cache.block_size
    cap = full_length_blocks(config)
    if cache.num_kv_blocks is not None:
        num_blocks = cache.num_kv_blocks
    elif device.type == "cuda":
        fits = profile(spec.bytes_per_block(block_size))
        if fits < 1:
            raise ValueError(
                f"no GPU memory left for the KV cache: gpu_memory_utilization={cache.gpu_memory_utilization} is "
                "below what weights and the activation peak take (see the log for the figures)"
            )
        num_blocks = min(fits, cap)
        if num_blocks < fits:
            logger.info("KV cache: %d blocks (max_num_seqs=%d sequences of max_model_len=%d) of the %d that fit",
                        num_blocks, config.scheduler_config.max_num_seqs, config.max_model_len, fits)  # fmt: skip
    else:
        by_memory = int(cache.kv_cache_memory_gib * 2**30) // spec.bytes_per_block(block_size)
        num_blocks = max(1, min(by_memory, cap))
    per_seq = math.ceil(config.max_model_len / block_size)
    if num_blocks < per_seq:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks ({num_blocks * block_size} tokens) but one sequence of "
            f"max_model_len={config.max_model_len} needs {per_seq} blocks: lower max_model_len or give the "
            "cache more memory (num_kv_blocks, kv_cache_memory_gib or gpu_memory_utilization)"
        )
    return num_blocks


def num_cpu_blocks(config: EngineConfig, spec: KVCacheSpec, device: torch.device, num_gpu_blocks: int) -> int:
    """CPU blocks of swap space, or 0 when preemption recomputes. By default a GPU swaps (swap_space > 0), unless
    its ``num_gpu_blocks`` hold ``max_num_seqs`` sequences of ``max_model_len``: the running sequences cannot
    run out of blocks then, and gigabytes of pinned memory would be allocated (and freed at exit) for nothing.
    On a CPU device swapping would copy from CPU memory to CPU memory, so it is used only when asked for."""
    mode = config.scheduler_config.preemption_mode
    if mode is None:
        mode = "swap" if device.type == "cuda" and config.cache_config.swap_space > 0 else "recompute"
        if mode == "swap" and num_gpu_blocks >= full_length_blocks(config):
            logger.info("swap space: none (the KV cache holds max_num_seqs sequences of max_model_len)")
            return 0
    if mode == "recompute":
        return 0
    block_bytes = spec.bytes_per_block(config.block_size)
    num_blocks = int(config.cache_config.swap_space * 2**30) // block_bytes
    logger.info("swap space: %d CPU blocks (%.2f GiB)", num_blocks, num_blocks * block_bytes / 2**30)
    return num_blocks


def full_length_blocks(config: EngineConfig) -> int:
    """Blocks for ``max_num_seqs`` sequences of ``max_model_len``: all the running sequences can ever hold."""
    return config.scheduler_config.max_num_seqs * math.ceil(config.max_model_len / config.cache_config.block_size)
