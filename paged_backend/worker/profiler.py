"""GPU memory profiling: the activation peak of one full-budget forward, to size the KV cache."""

from __future__ import annotations

import itertools
import logging
import math

import torch
from transformers import PreTrainedModel

from paged_backend.config import EngineConfig
from paged_backend.worker.cache_engine import CacheEngine, KVCacheSpec
from paged_backend.worker.model_runner import ModelRunner
from paged_backend.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

# Dummy sequences are at most this long: enough to exercise the attention path without a quadratic blow-up.
PROFILE_SEQ_LEN = 1024


@torch.inference_mode()
def profile_peak_memory(model: PreTrainedModel, config: EngineConfig, device: torch.device) -> int:
    """Peak bytes allocated (weights included, the temporary cache excluded) by a forward over
    ``max_num_batched_tokens`` tokens split into sequences of up to ``PROFILE_SEQ_LEN``."""
    block_size = config.block_size
    num_tokens = config.max_num_batched_tokens
    seq_len = max(1, min(num_tokens, config.max_model_len - 1, PROFILE_SEQ_LEN))
    num_seqs = math.ceil(num_tokens / seq_len)
    blocks_per_seq = math.ceil(seq_len / block_size)
    spec = KVCacheSpec.from_config(model.config, model.dtype)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    cache = CacheEngine(spec, num_seqs * blocks_per_seq, block_size, device)
    cache_bytes = cache.num_blocks * spec.bytes_per_block(block_size)
    runner = ModelRunner(model, cache, device, batch_invariant=config.model_config.batch_invariant)
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    positions = torch.cat([torch.arange(n) for n in lens])  # [T]
    owner = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])  # [T]
    block_tables = torch.arange(len(lens) * blocks_per_seq, dtype=torch.int32).view(len(lens), blocks_per_seq)
    cu_seqlens_q = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    vocab = model.config.get_text_config().vocab_size
    inputs = StepInputs(
        input_ids=torch.randint(0, vocab, (num_tokens,)),
        positions=positions,
        slot_mapping=owner * blocks_per_seq * block_size + positions,
        block_tables=block_tables,
        cu_seqlens_q=cu_seqlens_q,
        context_lens=torch.tensor(lens),
        logits_indices=(cu_seqlens_q[1:] - 1).long(),
    )
    runner.run(inputs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del runner, cache
    torch.cuda.empty_cache()
    return peak - cache_bytes


def gpu_blocks_that_fit(model: PreTrainedModel, config: EngineConfig, device: torch.device, block_bytes: int) -> int:
    """KV blocks that fit in ``gpu_memory_utilization`` of the GPU once weights and the activation peak of a
    ``max_num_batched_tokens`` forward are accounted for (zero or less when nothing fits); never more than the
    device has free beside that peak's activations and half the slack the fraction leaves (for CUDA graphs,
    workspaces, fragmentation). The engine shares its process: what the caller holds and what the caching
    allocator cannot hand back (segments that still hold a live tensor, other processes' memory) is not there
    for the cache, whatever the fraction says."""
    total = torch.cuda.get_device_properties(device).total_memory
    utilization = config.cache_config.gpu_memory_utilization
    peak = profile_peak_memory(model, config, device)
    budget = total * utilization - peak
    activations = peak - torch.cuda.memory_allocated(device)
    room = torch.cuda.mem_get_info(device)[0] - activations - total * (1 - utilization) / 2  # the cap
    logger.info(
        "GPU memory on %s: total %.1f GiB, weights + activation peak %.1f GiB, KV budget %.1f GiB",
        device,
        total / 2**30,
        peak / 2**30,
        max(0.0, min(budget, room)) / 2**30,
    )
    if room < budget:
        logger.warning(
            "the KV cache gets %.1f GiB, not the %.1f GiB that gpu_memory_utilization=%s allows: the rest is held "
            "by this process's other tensors, by allocator segments it cannot release, or by other processes",
            max(0.0, room) / 2**30,
            budget / 2**30,
            utilization,
        )
    return int(min(budget, room) // block_bytes)
