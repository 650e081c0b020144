"""Verifying proposed tokens (speculative decoding) with the sampler itself.

A sequence with proposals d_1 .. d_k has k + 1 logit rows: after its last sampled token, then after each
proposal. The sampler draws at every row as if the proposals before it had been taken — penalties,
``min_tokens`` and logits processors see them through a view of the sequence (``draft_views``) — and the
sequence takes its draws up to the first that differs from its proposal, that draw included; when every
proposal matches, the draw after the last one too (``take_verified``).

This is exact. For a proposal that is a single token (a point mass q = δ_d, as prompt lookup's are), Leviathan
et al.'s rule — take d with probability min(1, p(d) / q(d)) = p(d), else draw from (p − q)+ normalised, which is
p without d — is the same as drawing x ~ p and taking d when x = d, else x. Greedy rows take each row's argmax,
so their output equals decoding without proposals token for token. A seeded request draws from its own
generator, row after row, so it repeats itself (though not a run without proposals, which draws less often).
"""

from __future__ import annotations

from dataclasses import replace

from paged_backend.core.scheduler_output import ScheduledBatch
from paged_backend.core.sequence import Sequence
from paged_backend.core.spec_decode import taken_proposals
from paged_backend.worker.sampler import SampleResult


def sampling_drafts(batch: ScheduledBatch, num_sampling: int) -> list[list[int]] | None:
    """Each sampling sequence's proposals (``SchedulerOutput.sampling_seqs`` order: the sampling rows, then
    forked samples, which have none), or None when the step has none."""
    if batch.draft_token_ids is None:
        return None
    drafts = [batch.draft_token_ids[row] for row in batch.sampling_rows]
    return drafts + [[] for _ in range(num_sampling - len(drafts))]


def draft_views(seqs: list[Sequence], drafts: list[list[int]] | None) -> tuple[list[Sequence], list[int]]:
    """The sequences a logit row each (a sequence, then a view of it per proposal: as if it had taken the ones
    before, its grammar too), and where each sequence's first row is."""
    if drafts is None:
        return seqs, list(range(len(seqs)))
    views: list[Sequence] = []
    firsts: list[int] = []
    for seq, proposed in zip(seqs, drafts):
        firsts.append(len(views))
        views.append(seq)
        if not _reads_its_tokens(seq):  # the sampler sees only its parameters: no copies
            views += [seq] * len(proposed)
            continue
        grammar = seq.grammar.fork() if seq.grammar is not None and proposed else None
        for j in range(1, len(proposed) + 1):
            if grammar is not None:  # this view's own place in the grammar: after the proposals before it
                grammar.accept_token(proposed[j - 1])
            # after a proposal that ends the grammar nothing is taken: its row is drawn unmasked, and dropped
            view_grammar = None if grammar is None or grammar.is_terminated() else grammar.fork()
            views.append(replace(seq, token_ids=seq.token_ids + proposed[:j], grammar=view_grammar))
    return views, firsts


def _reads_its_tokens(seq: Sequence) -> bool:
    """Whether sampling ``seq`` reads its tokens (penalties, logits processors, a grammar, ``min_tokens``' bar on
    stop tokens), so that a view after a proposal must hold the proposals before it."""
    params = seq.params
    return (
        seq.grammar is not None
        or params.has_penalties
        or bool(params.logits_processors)
        or seq.num_output_tokens < params.min_tokens
    )


def take_verified(results: list[SampleResult], drafts: list[list[int]] | None) -> list[list[SampleResult]]:
    """Each sequence's draws that it takes: all of them up to the first that differs from its proposal."""
    if drafts is None:
        return [[result] for result in results]
    taken: list[list[SampleResult]] = []
    at = 0
    for proposed in drafts:
        draws = results[at : at + len(proposed) + 1]
        at += len(proposed) + 1
        taken.append(draws[: taken_proposals([draw.token_id for draw in draws], proposed) + 1])
    return taken
