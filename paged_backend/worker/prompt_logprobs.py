"""Prompt logprobs: each prompt token's log probability under the model given the tokens before it, its rank,
and the top k — from the raw logits (no penalty or temperature), as vLLM reports them and as evaluation
harnesses sum them.

The logits of a prefill chunk's positions come to the sampler's side as ``[P, V]`` in the model's dtype. A
logprob is a logit minus its row's logsumexp, so only the entries kept are normalised: ``kernels/token_rank.py``
reads each row once for its logsumexp, the prompt token's rank and the argmax (the top 1), and no ``[P, V]``
float32 tensor is made. What is kept stays on the device until the end: one host read a step.
"""

from __future__ import annotations

import torch

from paged_backend.kernels.token_rank import token_rank
from paged_backend.logprobs import LogprobsArrays


@torch.inference_mode()
def prompt_logprobs(logits: torch.Tensor, next_tokens: list[int], k: int) -> LogprobsArrays:
    """``logits`` [P, V] at P positions; ``next_tokens`` [P] the prompt token after each; the top ``k`` of each
    position listed after that token."""
    targets = torch.tensor(next_tokens, dtype=torch.long, device=logits.device)  # [P]
    lse, ranks, argmax = token_rank(logits, targets)  # [P] each
    if k == 1:
        top_ids = argmax[:, None]
    elif k > 1:  # the logits' order is the logprobs'
        top_ids = logits.topk(k, dim=-1).indices
    else:
        top_ids = targets[:, None][:, :0]  # [P, 0]
    ids = torch.cat([targets[:, None], top_ids], dim=1)  # [P, 1 + k]
    values = logits.gather(1, ids).float() - lse[:, None]
    return LogprobsArrays(ids.cpu().numpy(), values.cpu().numpy(), ranks.cpu().numpy())
