"""Prompt logprobs: each prompt token's log probability under the model given the tokens before it, its rank,
and the top k — from the raw logits (no penalty or temperature), as vLLM reports them and as evaluation
harnesses sum them.

The logits of a prefill chunk's positions come to the sampler's side as ``[P, V]`` in the model's dtype; they
are turned into float32 log probabilities a slice of rows at a time, so a long chunk never holds a
``[P, V]`` float32 tensor. What each slice keeps stays on the device until the last one: one host read a step.
"""

from __future__ import annotations

import torch

from paged_backend.logprobs import LogprobsArrays

ROWS_PER_SLICE = 256  # float32 [256, 128k] is 128 MiB


@torch.inference_mode()
def prompt_logprobs(logits: torch.Tensor, next_tokens: list[int], k: int) -> LogprobsArrays:
    """``logits`` [P, V] at P positions; ``next_tokens`` [P] the prompt token after each; the top ``k`` of each
    position listed after that token."""
    targets = torch.tensor(next_tokens, dtype=torch.long, device=logits.device)[:, None]  # [P, 1]
    ids, values, ranks = [], [], []
    for start in range(0, logits.shape[0], ROWS_PER_SLICE):
        rows = slice(start, start + ROWS_PER_SLICE)
        logprobs = torch.log_softmax(logits[rows].float(), dim=-1)  # [S, V]
        chosen = logprobs.gather(1, targets[rows])  # [S, 1]
        ranks.append((logprobs > chosen).sum(-1) + 1)  # [S]
        top_values, top_ids = logprobs.topk(k, dim=-1)  # [S, k]
        ids.append(torch.cat([targets[rows], top_ids], dim=1))
        values.append(torch.cat([chosen, top_values], dim=1))
    return LogprobsArrays(torch.cat(ids).cpu().numpy(), torch.cat(values).cpu().numpy(), torch.cat(ranks).cpu().numpy())
