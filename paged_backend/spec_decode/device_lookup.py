"""Prompt lookup on the device: ``NgramProposer``'s search over every row of a batch at once, in tensor operations
of fixed shapes, so that a round of verifying steps can run back to back without the host (worker/lookup_round.py).

Each row holds its token ids in ``history[b, :lens[b]]``. A candidate end ``e`` (an earlier token equal to the
last one) matches as many tokens as its run of equal tokens going back, up to ``max_n``; the longest match wins,
at least ``min_n`` long, and among equals the most recent: the proposals are the ``k`` tokens after it, those
to the row's end repeated as a period where they run out. Same rule, same proposals as
spec_decode/ngram_proposer.py.
"""

from __future__ import annotations

import torch


def device_lookup(
    history: torch.Tensor,  # [B, C] token ids, row b's first lens[b] real
    lens: torch.Tensor,  # [B] int64, each at least 1
    min_n: int,
    max_n: int,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` proposal slots ``[B, k]`` and how many of them are proposals ``[B]`` (0: no match)."""
    capacity = history.shape[1]
    device = history.device
    ends = torch.arange(capacity, device=device)  # [C] candidate ends
    backs = torch.arange(max_n, device=device)  # [N] tokens back from an end
    last = lens - 1  # [B] the position of each row's last token
    # the token ``back`` before each end (-1 before the row's start: never a token id), back by back: [B, C] at a
    # time, not [B, C, N], which a long max_model_len makes large
    earlier = torch.cat([history.new_full((history.shape[0], max_n - 1), -1), history], dim=1)
    target = history.gather(1, (last[:, None] - backs).clamp(min=0))  # [B, N] the last token's, ``back`` before
    # the host compares back to min(max_n, length - 1) tokens: the last token's run never reaches position 0
    usable = backs[None, :] < last.clamp(min=1)[:, None]  # [B, N]
    alive = ends[None, :] < last[:, None]  # [B, C] an end before the last token, its run unbroken so far
    matched = torch.zeros_like(history)
    for back in range(max_n):
        before = earlier[:, max_n - 1 - back : max_n - 1 - back + capacity]  # [B, C]
        alive = alive & (before == target[:, back : back + 1]) & usable[:, back : back + 1]
        matched += alive
    found = matched >= min_n
    score = torch.where(found, matched * capacity + ends[None, :], -1)  # longest first, then the latest end
    best, end = score.max(dim=1)
    start = end + 1
    period = (lens - start).clamp(min=1)  # the tokens after the match, to the row's end (at least one if found)
    slots = (start[:, None] + torch.arange(k, device=device)[None, :] % period[:, None]).clamp(max=capacity - 1)
    count = torch.where(best >= 0, k, 0)
    return history.gather(1, slots), count
