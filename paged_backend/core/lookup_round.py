"""Prompt lookup's rounds on the device: while text is being copied, verifying steps run back to back without the
host, each looking up its own proposals (worker/lookup_round.py); the scheduler plans them here.

A verifying step planned on the host waits for the step before it to be read, and the host's lookup and launch take
longer than a small model's forward: the device idles between verifying steps. A lookup round queues
``LOOKUP_ROUND_STEPS`` of them at once, and under async scheduling the round after it is queued before it is read,
so the device runs verifying steps back to back as it runs a multi-step round's decodes. A round costs every row
``k + 1`` tokens a step whether its lookup finds anything or not, so it runs only where copying pays: a batch of
greedy rows (``multi_step.can_run_ahead``) each proposed for by the host this step, after a verifying step that took
all its proposals. A round started so is read before another is queued: a host step that took a few proposals is
weak evidence (in open chat the copy mostly ends there, and a round queued blindly behind it would cost its steps
for a token each). After a round read that yielded ``LOOKUP_ROUND_MIN_YIELD`` tokens a step or more, the next is
queued behind each round, before it is read; otherwise the host's verifying steps and pauses (core/spec_decode.py)
go on as before. A round is no longer than its rows' ``max_tokens`` likely leave at that yield. Each row holds slots
for every token the rounds in flight could take (``k + 1`` a step); those it does not take lie past its length and
are written over later. A row the round ended (a stop token, ``max_tokens``) takes its tokens up to the end, the
rest computed for nothing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from paged_backend.core.multi_step import can_run_ahead
from paged_backend.core.scheduler_output import LookupRound, ScheduledBatch, SchedulerOutput
from paged_backend.core.sequence import Sequence, SequenceStatus
from paged_backend.core.spec_chain import allocate_spans
from paged_backend.core.spec_decode import DraftPlanner
from paged_backend.spec_decode.ngram_proposer import NgramProposer

if TYPE_CHECKING:
    from paged_backend.core.scheduler import Scheduler

LOOKUP_ROUND_STEPS = 4
# A round started from a host step (the host saw its row take every proposal) knows less of what its lookups will
# find than one queued after a round read that paid: it runs this many steps, then is read before the next
LOOKUP_FIRST_ROUND_STEPS = 4
LOOKUP_ROUND_MAX_ROWS = 8  # a round verifies k + 1 tokens a row a step: a small batch's, where the device waits
# A round goes on while its last one read yielded this many tokens a verifying step: a verifying forward of k + 1
# tokens costs more than a decode's, so a round that yields much less than two a step is better decoded plainly
LOOKUP_ROUND_MIN_YIELD = 2.0


def lookup_round(scheduler: Scheduler, output: SchedulerOutput) -> SchedulerOutput | None:
    """``output`` (a step whose rows verify the host's proposals) as a lookup round, or None when it cannot be
    one: a row without proposals or whose last verifying step missed, or what ``_runnable`` refuses."""
    batch, drafter = output.batch, scheduler.drafter
    if drafter is None or batch.draft_token_ids is None or output.fork_parents or output.kv_imports:
        return None
    if batch.blocks_to_copy or batch.blocks_to_swap_in or batch.blocks_to_swap_out or batch.prompt_logprob_rows:
        return None
    seqs = output.seqs
    if not all(drafts and seq.spec_took_all for seq, drafts in zip(seqs, batch.draft_token_ids)):
        return None
    steps = min(LOOKUP_FIRST_ROUND_STEPS, _round_steps(seqs, 0))
    if steps == 0 or not _runnable(scheduler, drafter, seqs, [0] * len(seqs), steps):
        return None
    return _round_output(scheduler, drafter, seqs, steps, [list(seq.token_ids) for seq in seqs])


def lookup_continuation(scheduler: Scheduler, in_flight: SchedulerOutput) -> SchedulerOutput | None:
    """The lookup round after ``in_flight`` (one queued, not read), from where the device leaves its rows; None
    unless every row's last step read was a round that yielded enough, or what ``_runnable`` refuses."""
    drafter, plan = scheduler.drafter, in_flight.batch.lookup_round
    if drafter is None or plan is None:
        return None
    seqs = in_flight.seqs
    if not all(seq.lookup_round_paid for seq in seqs):
        return None
    ahead = plan.num_steps * (plan.num_speculative_tokens + 1)  # the most each row takes in the round in flight
    steps = _round_steps(seqs, plan.num_steps)
    if steps == 0 or not _runnable(scheduler, drafter, seqs, [ahead] * len(seqs), steps):
        return None
    return _round_output(scheduler, drafter, seqs, steps, None, ahead)


def _round_steps(seqs: list[Sequence], steps_ahead: int) -> int:
    """A round's steps: LOOKUP_ROUND_STEPS, fewer where every row is likely to reach ``max_tokens`` sooner at the
    yield that keeps rounds going (a round's steps after its rows ended are computed for nothing, and the device
    runs them before whatever comes next); 0 when they likely end in the ``steps_ahead`` steps in flight."""
    longest = 0
    for seq in seqs:
        if seq.params.max_tokens is None:
            return LOOKUP_ROUND_STEPS
        left = seq.params.max_tokens - seq.num_output_tokens - LOOKUP_ROUND_MIN_YIELD * steps_ahead
        longest = max(longest, math.ceil(left / LOOKUP_ROUND_MIN_YIELD))
    return max(0, min(LOOKUP_ROUND_STEPS, longest))


def _runnable(scheduler: Scheduler, drafter: DraftPlanner, seqs: list[Sequence], ahead: list[int], steps: int) -> bool:
    """Whether ``seqs`` (every running sequence) can run a lookup round of ``steps`` after ``ahead`` more tokens
    each, their slots for it allocated (then True)."""
    if not isinstance(drafter.proposer, NgramProposer) or not scheduler.grammar_rounds or scheduler.max_loras:
        return False
    if scheduler.swapped or scheduler.run_alone or len(seqs) != len(scheduler.running):
        return False
    if scheduler.waiting and len(scheduler.running) < scheduler.max_num_seqs:
        return False  # a waiting request may get a place: the next step admits it
    k = drafter.k
    if len(seqs) > LOOKUP_ROUND_MAX_ROWS or not drafter.active(len(seqs)):
        return False
    if len(seqs) * (k + 1) > scheduler.max_num_batched_tokens:
        return False
    span = steps * (k + 1)
    for seq, n in zip(seqs, ahead):
        if seq.status is not SequenceStatus.RUNNING or not can_run_ahead(seq, False) or seq.grammar is not None:
            return False
        if not drafter.speculates(seq, n) or len(seq.token_ids) - 1 + n + span > scheduler.max_model_len:
            return False
    return allocate_spans(scheduler, seqs, [(seq.num_computed_tokens, n + span) for seq, n in zip(seqs, ahead)])


def _round_output(
    scheduler: Scheduler,
    drafter: DraftPlanner,
    seqs: list[Sequence],
    steps: int,
    history: list[list[int]] | None,
    ahead: int = 0,
) -> SchedulerOutput:
    max_lens = []
    for seq in seqs:
        limit = scheduler.max_model_len
        if seq.params.max_tokens is not None:
            limit = min(limit, seq.num_prompt_tokens + seq.params.max_tokens)
        max_lens.append(limit)
    proposer = drafter.proposer
    assert isinstance(proposer, NgramProposer)
    plan = LookupRound(
        num_steps=steps,
        num_speculative_tokens=drafter.k,
        ngram_sizes=(proposer.min_n, proposer.max_n),
        max_lens=max_lens,
        capacity=scheduler.max_model_len,
        history=history,
    )
    bm = scheduler.block_manager
    batch = ScheduledBatch(
        input_token_ids=[seq.token_ids[-1] for seq in seqs],  # the device feeds its own (``history``)
        num_computed_tokens=[seq.num_computed_tokens + ahead for seq in seqs],  # at least: the device knows
        num_scheduled_tokens=[1] * len(seqs),
        block_tables=[bm.get_block_table(seq.seq_id) for seq in seqs],
        sampling_rows=list(range(len(seqs))),
        lookup_round=plan,
    )
    return SchedulerOutput(batch, list(seqs), list(seqs))


def observe_lookup_round(drafter: DraftPlanner, seq: Sequence, counts: list[tuple[int, int]], num_taken: int) -> None:
    """After ``seq`` took ``num_taken`` tokens of a lookup round whose steps made and took ``counts`` proposals:
    each step up to the last token taken counts as a verifying step (the engine's and the sample's counts, the
    sample judged), and whether its rounds go on (``LOOKUP_ROUND_MIN_YIELD``)."""
    steps = 0
    for proposed, taken in counts:
        if num_taken <= 0:
            break
        if proposed:
            drafter.count(seq, proposed, min(taken, num_taken))
        num_taken -= taken + 1
        steps += 1
    paid = steps > 0 and sum(t + 1 for _, t in counts[:steps]) >= LOOKUP_ROUND_MIN_YIELD * steps
    seq.spec_took_all = seq.lookup_round_paid = paid
