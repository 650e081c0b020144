"""Paged attention's torch twin (kernels/paged_attention.py holds the Triton kernel and its conventions): the
reference the kernel is tested against, and the engine's attention on a CPU.

Decodes are batched together; each prefill is computed on its own, so the padded context stays ``[1, ctx_len]``
instead of growing with the batch. Where each batch reads its context and what each query may see (the plan)
depends only on the step's block tables and lengths, not on the layer: the engine on a CPU builds it once a step
(``AttentionMetadata.twin_plans``) instead of once a layer; for one stream at short contexts it is about half the
twin's time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TwinGroup:
    """One batch of the twin: every decode of the step, or one prefill."""

    slots: torch.Tensor  # [G, C] int64: the cache rows (``[NB * BS]``) of each sequence's context
    token_idx: torch.Tensor  # [G, Q] the query rows (a padded row repeats a real one)
    allowed: torch.Tensor  # [G, 1, Q, C] bool: what each query may see
    out_rows: torch.Tensor | slice  # where its [G, Q] outputs go: decodes' token rows, or one prefill's range


def twin_plan(
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32, cached + new tokens
    block_size: int,
    sliding_window: int | None,
) -> list[TwinGroup]:
    """The twin's batches for a step: what each reads and sees, the same in every layer with this window."""
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # [B]
    q_lens_list = q_lens.tolist()
    ctx_list = context_lens.tolist()
    starts = cu_seqlens_q.tolist()
    device = block_tables.device
    decodes = [i for i, n in enumerate(q_lens_list) if n == 1]
    plan = []
    for group in ([decodes] if decodes else []) + [[i] for i, n in enumerate(q_lens_list) if n > 1]:
        idx = torch.tensor(group, device=device)
        max_q = max(q_lens_list[i] for i in group)
        kv_pos = torch.arange(max(ctx_list[i] for i in group), device=device)  # [C]
        slots = block_tables[idx][:, kv_pos // block_size].long() * block_size + kv_pos % block_size  # [G, C]
        q_idx = torch.arange(max_q, device=device)  # [Q]
        q_starts = cu_seqlens_q[idx].long()
        token_idx = (q_starts[:, None] + q_idx[None, :]).clamp(max=starts[-1] - 1)  # [G, Q]
        q_pos = (context_lens[idx] - q_lens[idx]).long()[:, None] + q_idx[None, :]  # [G, Q]
        allowed = kv_pos[None, None, :] <= q_pos[:, :, None]  # [G, Q, C]
        if sliding_window is not None:
            allowed &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        first, n = starts[group[0]], q_lens_list[group[0]]
        out_rows = q_starts if max_q == 1 else slice(first, first + n)
        plan.append(TwinGroup(slots, token_idx, allowed[:, None], out_rows))
    return plan


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache``'s rows at ``slots`` (any shape): ``[*slots.shape, Hkv, D]``, by ``index_select``, which on a CPU
    copies whole rows several times faster than advanced indexing; a cache stored otherwise (a GPU's head-major
    one, a value cache stored transposed: kernels/cache_write.py) by its blocks and offsets."""
    if not cache.is_contiguous():
        return cache[slots // cache.shape[1], slots % cache.shape[1]]
    flat = cache.flatten(0, 1)
    return flat.index_select(0, slots.flatten()).view(*slots.shape, *flat.shape[1:])


def _attend_group(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    group: TwinGroup,
    scale: float,
    softcap: float | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:  # [G, Q, H, D] (rows past a prefill's q_len are garbage)
    groups, max_q = group.token_idx.shape
    num_kv_heads, (num_heads, head_dim) = k_cache.shape[2], query.shape[1:]
    per_kv = num_heads // num_kv_heads  # query heads sharing a KV head (h = kv * per_kv + r)
    keys = gather_slots(k_cache, group.slots).float().transpose(1, 2)  # [G, Hkv, C, D]
    values = gather_slots(v_cache, group.slots).float().transpose(1, 2)  # [G, Hkv, C, D]
    if k_scale is not None and v_scale is not None:
        keys, values = keys * k_scale[:, None, None], values * v_scale[:, None, None]
    queries = query[group.token_idx].float().view(groups, max_q, num_kv_heads, per_kv, head_dim)  # [G,Q,Hkv,R,D]
    # one product per KV head over all the query heads that share it: [G, Hkv, R * Q, D], row r * Q + q
    queries = queries.permute(0, 2, 3, 1, 4).reshape(groups, num_kv_heads, per_kv * max_q, head_dim)
    allowed = group.allowed  # [G, 1, Q, C]: one query a sequence is every row's, else each row its query's
    if max_q > 1:
        allowed = allowed[:, :, None].expand(-1, -1, per_kv, -1, -1).reshape(groups, 1, per_kv * max_q, -1)
    if softcap is None:  # [G, Hkv, R * Q, D]; torch's fused kernel keeps no score tensor (the CPU engine's path)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=allowed, scale=scale)
        out = out.nan_to_num_(0.0)  # a row that sees no key (a padding sequence): 0, as torch before 2.5 did not
    else:
        scores = torch.tanh(queries @ keys.transpose(-1, -2) * scale / softcap) * softcap
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
        out = probs @ values
    out = out.view(groups, num_kv_heads, per_kv, max_q, head_dim).permute(0, 3, 1, 2, 4)  # [G, Q, Hkv, R, D]
    return out.reshape(groups, max_q, num_heads, head_dim)


def paged_attention_torch(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32, cached + new tokens
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,  # [Hkv] fp32, fp8 caches only
    v_scale: torch.Tensor | None = None,  # [Hkv] fp32, fp8 caches only
    plan: list[TwinGroup] | None = None,  # ``twin_plan`` of these tables, lengths and window, if made already
) -> torch.Tensor:  # [T, H, D]
    """Reference twin, in fp32."""
    if plan is None:
        plan = twin_plan(block_tables, cu_seqlens_q, context_lens, k_cache.shape[1], sliding_window)
    out = torch.empty_like(query)
    for group in plan:
        result = _attend_group(query, k_cache, v_cache, group, scale, softcap, k_scale, v_scale)  # [G, Q, H, D]
        if isinstance(group.out_rows, slice):  # a single prefill
            out[group.out_rows] = result[0, : group.out_rows.stop - group.out_rows.start].to(out.dtype)
        else:
            out[group.out_rows] = result[:, 0].to(out.dtype)
    return out
