"""The cache write and paged attention as ``torch.library`` custom ops, so ``torch.compile`` keeps them opaque
(one node each, no graph break) while it fuses the model's small ops around them. Each op runs the Triton
kernel on CUDA and the torch twin elsewhere. Outside compilation the attention function calls the dispatchers
directly, skipping the custom-op dispatch cost."""

from __future__ import annotations

import torch

from paged_backend.kernels import triton
from paged_backend.kernels.attention_twin import TwinGroup, paged_attention_torch, twin_plan
from paged_backend.kernels.cache_write import write_kv_cache_torch, write_kv_cache_triton
from paged_backend.kernels.paged_attention import paged_attention_triton


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = padding
    k_scale: torch.Tensor | None = None,  # [Hkv] fp32, fp8 caches only
    v_scale: torch.Tensor | None = None,
) -> None:
    if key.is_cuda and triton is not None:
        write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        write_kv_cache_torch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    k_scale: torch.Tensor | None = None,  # [Hkv] fp32, fp8 caches only
    v_scale: torch.Tensor | None = None,
    batch_invariant: bool = False,  # the Triton kernel's fixed-order configuration (the twin is not invariant)
    twin_plans: dict[int | None, list[TwinGroup]] | None = None,  # the twin's plans of this step, by window
) -> torch.Tensor:  # [T, H, D]
    args = (query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, sliding_window, softcap)
    if query.is_cuda and triton is not None:
        return paged_attention_triton(*args, k_scale=k_scale, v_scale=v_scale, batch_invariant=batch_invariant)
    plan = None
    if twin_plans is not None:  # made by the step's first layer with this window, used by the others
        plan = twin_plans.get(sliding_window)
        if plan is None:
            plan = twin_plans[sliding_window] = twin_plan(
                block_tables, cu_seqlens_q, context_lens, k_cache.shape[1], sliding_window
            )
    return paged_attention_torch(*args, k_scale=k_scale, v_scale=v_scale, plan=plan)


@torch.library.custom_op("paged_backend::write_kv_cache", mutates_args=("k_cache", "v_cache"))
def write_kv_cache_op(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@torch.library.custom_op("paged_backend::paged_attention", mutates_args=())
def paged_attention_op(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int,  # 0 = none
    softcap: float,  # 0 = none
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:
    return paged_attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        scale,
        sliding_window or None,
        softcap or None,
        k_scale,
        v_scale,
    )


@paged_attention_op.register_fake
def _paged_attention_fake(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:
    return query.new_empty(query.shape)
