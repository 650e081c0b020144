"""One verifying step of a lookup round in tensor operations of fixed shapes: the forward's inputs from each row's
token ids on the device, and the tokens it takes after the forward. worker/lookup_round.py runs them eagerly,
worker/lookup_graphs.py captures them in CUDA graphs; both are the host's verifying step's rule
(worker/rejection_sampler.py's greedy case): proposals taken while the greedy token at their position matches,
then the model's own token.
"""

from __future__ import annotations

import torch

from paged_backend.spec_decode.device_lookup import device_lookup


def token_rows(rows: list[list[int]], num_rows: int) -> torch.Tensor:
    """Each row's token ids from the left of a ``[num_rows, longest row]`` host tensor (zeros past them, and in the
    rows past ``rows``: padding), for the left columns of a ``[B, C]`` history: a lookup reads no column at or
    past a row's length, so the columns right of the longest row need no copy (at a long ``max_model_len`` most
    of them)."""
    ids = torch.zeros(num_rows, max(map(len, rows), default=1), dtype=torch.long)
    for row, tokens in enumerate(rows):
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return ids


class LookupInputs:
    """A step's rows ``[B, k + 1]``: token ids (the row's last token, then its proposal slots), positions and
    cache slots; the proposals ``[B, k]`` and how many of them a row has ``[B]``."""

    def __init__(
        self,
        history: torch.Tensor,  # [B, C] token ids, row b's first lens[b] real
        lens: torch.Tensor,  # [B]
        max_lens: torch.Tensor,  # [B] each row's length limit
        tables: torch.Tensor,  # [B, W] int32 block tables
        ngram_sizes: tuple[int, int],
        k: int,
        block_size: int,
    ) -> None:
        self.proposals, proposed = device_lookup(history, lens, *ngram_sizes, k)
        # none past the row's length limit: the token after the last proposal is the model's own and must fit too
        self.proposed = torch.minimum(proposed, (max_lens - lens - 1).clamp(min=0))
        self.ids = torch.cat([history.gather(1, (lens - 1)[:, None]), self.proposals], dim=1)
        self.positions = (lens - 1)[:, None] + torch.arange(k + 1, device=history.device)
        blocks = tables.gather(1, (self.positions // block_size).clamp(max=tables.shape[1] - 1)).long()
        self.slots = blocks * block_size + self.positions % block_size


def take_tokens(
    proposals: torch.Tensor,  # [B, k]
    proposed: torch.Tensor,  # [B] how many of them are proposals
    tokens: torch.Tensor,  # [B, k + 1] the greedy token at every position
    logprobs: torch.Tensor,  # [B, k + 1]
    history: torch.Tensor,  # [B, C], written in place
    lens: torch.Tensor,  # [B], counted on in place
    live: torch.Tensor | None = None,  # [B] bool: rows that count their tokens (padding does not); None: all
) -> torch.Tensor:
    """The step's taken tokens written on in ``history`` and counted in ``lens``; its record ``[B, 2 (k + 1) + 2]``
    (float64: token ids below 2**53 are exact): every position's token and logprob, the proposals, those taken."""
    k = tokens.shape[1] - 1
    slots_k = torch.arange(k + 1, device=tokens.device)
    matches = (tokens[:, :k] == proposals) & (slots_k[None, :k] < proposed[:, None])
    taken = matches.long().cumprod(dim=1).sum(dim=1)  # [B] proposals taken, then the model's own token
    at = (lens[:, None] + slots_k).clamp(max=history.shape[1] - 1)
    history.scatter_(1, at, torch.where(slots_k[None, :] <= taken[:, None], tokens, history.gather(1, at)))
    lens.add_(taken + 1 if live is None else torch.where(live, taken + 1, 0))
    counts = torch.stack([proposed, taken], dim=1)
    return torch.cat([tokens.double(), logprobs.double(), counts.double()], dim=1)
