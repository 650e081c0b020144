"""Prompt logprobs on the scheduler's side: which rows of a step compute them, and where their entries go.

A request that asks for ``prompt_logprobs`` gets them from its first sample's prefill chunks: position ``p`` of
the prompt predicts token ``p + 1``, so a chunk of ``n`` tokens from ``start`` covers tokens ``start + 1`` to
``start + n`` (the prompt's last position predicts the first generated token, which is sampled, not scored). A
request preempted by recompute prefills again; the entries it already has are kept, not appended twice.
"""

from __future__ import annotations

from paged_backend.core.sequence import Sequence
from paged_backend.logprobs import LogprobsArrays


def prompt_logprob_rows(seqs: list[Sequence], num_new: list[int]) -> list[tuple[int, int]]:
    """(row, count) of the step's rows whose first ``count`` new tokens each have a prompt token next: the
    prefill chunks of a request's first sample while its prompt logprobs are incomplete."""
    rows = []
    for row, (seq, n) in enumerate(zip(seqs, num_new)):
        request = seq.request
        if request.needs_prompt_logprobs and seq is request.seqs[0]:
            count = min(seq.num_computed_tokens + n, seq.num_prompt_tokens - 1) - seq.num_computed_tokens
            if count > 0:
                rows.append((row, count))
    return rows


def take_prompt_logprobs(seq: Sequence, start: int, arrays: LogprobsArrays) -> None:
    """Entries for prompt tokens ``start + 1`` on, into the request; those it computed before are kept."""
    request = seq.request
    assert request.prompt_logprobs is not None, "only requests that asked for prompt logprobs get them"
    known = request.num_prompt_logprobs - start  # of this chunk's entries, those the request already has
    if 0 <= known < len(arrays):
        request.prompt_logprobs.append(arrays.take(known, len(arrays)))
        request.num_prompt_logprobs += len(arrays) - known
