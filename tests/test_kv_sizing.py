"""How many KV blocks the cache gets (worker/kv_sizing.py): what fits, never more than the running sequences can
use, and a clear error when not even one full-length sequence fits; swap space where it can be used."""

from __future__ import annotations

import math

import pytest
import torch

from paged_backend.config import EngineConfig
from paged_backend.worker.cache_engine import KVCacheSpec
from paged_backend.worker.kv_sizing import num_cpu_blocks, num_gpu_blocks

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
GPU = torch.device("cuda")  # only its type is read: the profile is given


def config(**kwargs) -> EngineConfig:
    return EngineConfig.from_kwargs("m", max_model_len=64, block_size=16, max_num_seqs=4, **kwargs).resolve(64)


def test_a_gpu_cache_is_what_fits_up_to_what_the_sequences_can_use() -> None:
    cap = 4 * math.ceil(64 / 16)  # max_num_seqs full-length sequences
    asked: list[int] = []

    def profile(fits: int):
        def blocks_that_fit(block_bytes: int) -> int:
            asked.append(block_bytes)
            return fits

        return blocks_that_fit

    assert num_gpu_blocks(config(), SPEC, GPU, profile(10**6)) == cap
    assert num_gpu_blocks(config(), SPEC, GPU, profile(cap - 3)) == cap - 3
    assert asked == [SPEC.bytes_per_block(16)] * 2
    assert num_gpu_blocks(config(num_kv_blocks=100), SPEC, GPU, profile(0)) == 100  # asked for: as asked


def test_a_cpu_cache_is_its_memory_up_to_what_the_sequences_can_use() -> None:
    cap = 4 * math.ceil(64 / 16)
    assert num_gpu_blocks(config(kv_cache_memory_gib=1.0), SPEC, torch.device("cpu"), lambda _: 0) == cap
    small = 6 * SPEC.bytes_per_block(16) / 2**30  # six blocks' worth: less than the cap, more than one sequence
    assert num_gpu_blocks(config(kv_cache_memory_gib=small), SPEC, torch.device("cpu"), lambda _: 0) == 6


def test_a_cache_without_room_for_one_sequence_is_an_error_naming_what_to_change() -> None:
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        num_gpu_blocks(config(), SPEC, GPU, lambda _: 0)
    with pytest.raises(ValueError, match="one sequence of max_model_len=64 needs 4 blocks"):
        num_gpu_blocks(config(), SPEC, GPU, lambda _: 3)


def test_swap_space_only_where_the_running_sequences_can_run_out_of_blocks() -> None:
    """A GPU swaps by default, but not when its cache holds max_num_seqs full-length sequences (nothing can be
    preempted for blocks then); preemption_mode="swap" still gets its swap space; a CPU swaps only when asked."""
    cap = 4 * math.ceil(64 / 16)
    gib = config().cache_config.swap_space
    swap_blocks = int(gib * 2**30) // SPEC.bytes_per_block(16)
    assert num_cpu_blocks(config(), SPEC, GPU, cap - 1) == swap_blocks
    assert num_cpu_blocks(config(), SPEC, GPU, cap) == 0
    assert num_cpu_blocks(config(preemption_mode="swap"), SPEC, GPU, cap) == swap_blocks
    assert num_cpu_blocks(config(preemption_mode="recompute"), SPEC, GPU, cap - 1) == 0
    assert num_cpu_blocks(config(swap_space=0), SPEC, GPU, cap - 1) == 0
    assert num_cpu_blocks(config(), SPEC, torch.device("cpu"), cap - 1) == 0
    assert num_cpu_blocks(config(preemption_mode="swap"), SPEC, torch.device("cpu"), cap) == swap_blocks
