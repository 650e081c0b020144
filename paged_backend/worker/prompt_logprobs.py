"""Prompt logprobs: each prompt token's log probability under the model given the tokens before it, its rank,
and the top k — from the raw logits (no penalty or temperature), as vLLM reports them and as evaluation
harnesses sum them.

The logits of a prefill chunk's positions come to the sampler's side as ``[P, V]`` in the model's dtype. A
logprob is a logit minus its row's logsumexp, so only the entries kept are normalised: ``kernels/token_rank.py``
reads each row once for its logsumexp, the prompt token's rank and the argmax (the top 1), and no ``[P, V]``
float32 tensor is made. What is kept stays on the device until the end: one host read a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from paged_backend.kernels.token_rank import token_rank
from paged_backend.logprobs import LogprobsArrays

if TYPE_CHECKING:
    from paged_backend.core.scheduler_output import SchedulerOutput


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


def step_prompt_logprobs(logits: torch.Tensor, scheduler_output: SchedulerOutput) -> dict[int, LogprobsArrays]:
    """Each prompt-logprob row's entries, from its positions' logits (the first rows of ``logits``)."""
    batch, next_tokens, top_k = scheduler_output.batch, [], []
    for row, count in batch.prompt_logprob_rows:
        seq, start = scheduler_output.seqs[row], batch.num_computed_tokens[row]
        next_tokens += seq.token_ids[start + 1 : start + 1 + count]
        top_k.append(seq.params.prompt_logprobs or 0)
    arrays = prompt_logprobs(logits, next_tokens, max(top_k))
    out, offset = {}, 0
    for (row, count), k in zip(batch.prompt_logprob_rows, top_k):
        out[row], offset = arrays.take(offset, offset + count, k), offset + count
    return out
