"""Prompt logprobs: each prompt token's log probability under the model given the tokens before it, its rank,
and the top k — from the raw logits (no penalty or temperature), as vLLM reports them and as evaluation
harnesses sum them.

The logits of a prefill chunk's positions come to the sampler's side as ``[P, V]`` in the model's dtype; they
are turned into float32 log probabilities a slice of rows at a time, so a long chunk never holds a
``[P, V]`` float32 tensor.
"""

from __future__ import annotations

import torch

from paged_backend.core.scheduler_output import TopLogprobs

ROWS_PER_SLICE = 256  # float32 [256, 128k] is 128 MiB


@torch.inference_mode()
def prompt_logprobs(logits: torch.Tensor, next_tokens: list[int], top_k: list[int]) -> list[TopLogprobs]:
    """``logits`` [P, V] at P positions; ``next_tokens`` [P] the prompt token after each; ``top_k`` [P] how many
    of the most likely to list. Each entry: the actual next token (its logprob and rank) first, then the top k."""
    entries: list[TopLogprobs] = []
    targets = torch.tensor(next_tokens, dtype=torch.long, device=logits.device)
    k_max = max(top_k, default=0)
    for start in range(0, logits.shape[0], ROWS_PER_SLICE):
        rows = slice(start, start + ROWS_PER_SLICE)
        logprobs = torch.log_softmax(logits[rows].float(), dim=-1)  # [S, V]
        chosen = logprobs.gather(1, targets[rows, None])  # [S, 1]
        ranks = (logprobs > chosen).sum(-1) + 1  # [S]
        top_vals, top_ids = logprobs.topk(max(1, k_max), dim=-1)
        chosen_list, rank_list = chosen[:, 0].tolist(), ranks.tolist()
        vals, ids = top_vals.tolist(), top_ids.tolist()
        for j in range(len(chosen_list)):
            k = top_k[start + j]
            entry = [(next_tokens[start + j], chosen_list[j], int(rank_list[j]))]
            entries.append(entry + [(tid, val, r + 1) for r, (tid, val) in enumerate(zip(ids[j][:k], vals[j][:k]))])
    return entries
