"""Paged attention: each sequence's new queries attend to its cached context through its block table.

Query ``j`` of a sequence with ``q_len`` new tokens and ``ctx_len`` tokens in the cache (new ones included)
sits at absolute position ``ctx_len - q_len + j`` and sees keys at positions ``<=`` that (causal), and with a
sliding window ``w`` only keys at positions ``> pos - w`` (transformers' convention).
"""

from __future__ import annotations

import torch


def _attend_group(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [G, max_blocks]
    q_starts: torch.Tensor,  # [G]
    q_lens: torch.Tensor,  # [G]
    context_lens: torch.Tensor,  # [G]
    max_q: int,
    max_ctx: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:  # [G, max_q, H, D] (rows past q_len are garbage)
    device = query.device
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_heads = query.shape[1]
    kv_pos = torch.arange(max_ctx, device=device)  # [C]
    slots = block_tables[:, kv_pos // block_size].long() * block_size + kv_pos % block_size  # [G, C]
    keys = k_cache.flatten(0, 1)[slots].float()  # [G, C, Hkv, D]
    values = v_cache.flatten(0, 1)[slots].float()  # [G, C, Hkv, D]
    if num_heads != num_kv_heads:
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=2)  # [G, C, H, D]
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=2)
    q_idx = torch.arange(max_q, device=device)  # [Q]
    token_idx = (q_starts[:, None] + q_idx[None, :]).clamp(max=query.shape[0] - 1)  # [G, Q]
    queries = query[token_idx].float()  # [G, Q, H, D]
    q_pos = (context_lens - q_lens)[:, None] + q_idx[None, :]  # [G, Q]
    allowed = kv_pos[None, None, :] <= q_pos[:, :, None]  # [G, Q, C]
    if sliding_window is not None:
        allowed &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    scores = torch.einsum("gqhd,gchd->ghqc", queries, keys) * scale  # [G, H, Q, C]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded query rows are fully masked
    return torch.einsum("ghqc,gchd->gqhd", probs, values)


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
) -> torch.Tensor:  # [T, H, D]
    """Reference twin, in fp32. Decodes are batched together; each prefill is computed on its own so the
    padded score tensor stays ``[1, H, q_len, ctx_len]`` instead of growing with the batch."""
    out = torch.empty_like(query)
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # [B]
    q_lens_list = q_lens.tolist()
    ctx_list = context_lens.tolist()
    starts = cu_seqlens_q.tolist()
    decodes = [i for i, n in enumerate(q_lens_list) if n == 1]
    groups = ([decodes] if decodes else []) + [[i] for i, n in enumerate(q_lens_list) if n > 1]
    for group in groups:
        idx = torch.tensor(group, device=query.device)
        max_q = max(q_lens_list[i] for i in group)
        max_ctx = max(ctx_list[i] for i in group)
        result = _attend_group(
            query,
            k_cache,
            v_cache,
            block_tables[idx],
            cu_seqlens_q[idx].long(),
            q_lens[idx].long(),
            context_lens[idx].long(),
            max_q,
            max_ctx,
            scale,
            sliding_window,
            softcap,
        )  # [G, Q, H, D]
        if max_q == 1:
            out[cu_seqlens_q[idx].long()] = result[:, 0].to(out.dtype)
        else:  # a single prefill
            start, n = starts[group[0]], q_lens_list[group[0]]
            out[start : start + n] = result[0, :n].to(out.dtype)
    return out
