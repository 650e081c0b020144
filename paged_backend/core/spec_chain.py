"""Speculative decoding under async scheduling: the verifying step after the one in flight, queued before that
one's tokens are known, on the guess that every row takes all of its proposals.

A verifying step's successor needs the step's tokens: its rows start after the last one taken, and prompt lookup
continues from there. Waiting for them leaves the GPU idle while the host reads the step, looks up proposals and
launches the next (on a small model, longer than the forward itself). So, as a multi-step round queues the round
after it (multi_step.py), a verifying step queues a successor that assumes each row takes all its proposals and
then the model's own token: that token is the greedy choice of the row's last logits, which the device has, and
the successor's proposals come from the lookup continued past the proposals in flight (``lookup_after``). When the
step is read, a row that took fewer proposals is stale in the successor: its positions were wrong, and the row is
skipped when the successor is read (``stale_rows``), its KV past the sequence's length written over later. A
successor with every row stale is dropped unread. Only greedy rows without logprobs, penalties or grammars are
chained (``multi_step.can_run_ahead``): the device's greedy token is then the one the sampler takes. A batch is
chained only while each row proposed for in the step in flight took all its proposals in its last verifying step
read (a row without proposals cannot be stale in the successor): text that is not being copied (open chat) misses
often and in runs, and a successor queued there is mostly work thrown away (docs/benchmarks.md has the three
workloads either way).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged_backend.core.multi_step import can_run_ahead
from paged_backend.core.scheduler_output import ScheduledBatch, SchedulerOutput
from paged_backend.core.sequence import Sequence, SequenceStatus
from paged_backend.core.spec_decode import DraftModelProposals, Proposer
from paged_backend.spec_decode.ngram_proposer import NgramProposer

if TYPE_CHECKING:
    from paged_backend.core.scheduler import Scheduler


def verify_continuation(scheduler: Scheduler, in_flight: SchedulerOutput) -> SchedulerOutput | None:
    """The verifying step after ``in_flight`` (a verifying step queued on the device, not read yet), planned as
    if every row takes all its proposals; None when the next step must be a normal one: the batch would change,
    a row is not greedy and plain, a row may end in ``in_flight``, or blocks are short."""
    batch, drafter = in_flight.batch, scheduler.drafter
    if batch.draft_token_ids is None or batch.num_steps is not None or drafter is None:
        return None
    if isinstance(drafter.proposer, DraftModelProposals) or not scheduler.grammar_rounds:  # lookups, one worker
        return None
    if scheduler.swapped or scheduler.run_alone or in_flight.fork_parents or stale_rows(in_flight):
        return None
    if scheduler.waiting and len(scheduler.running) < scheduler.max_num_seqs:
        return None  # a waiting request may get a place: the next step admits it
    seqs = in_flight.seqs
    if len(seqs) != len(scheduler.running) or batch.sampling_rows != list(range(len(seqs))):
        return None
    if not drafter.active(len(seqs)):
        return None
    if any(seq.status is not SequenceStatus.RUNNING or not can_run_ahead(seq, False) for seq in seqs):
        return None
    proposed = batch.draft_token_ids
    if not all(seq.spec_took_all for seq, drafts in zip(seqs, proposed) if drafts):
        return None  # a row that just took fewer than all likely misses again: its successor would be wasted
    if any(n != 1 + len(d) for n, d in zip(batch.num_scheduled_tokens, proposed)):
        return None  # a row that is no single token and its proposals (a prompt's chunk)
    rows: list[list[int]] = []
    for seq, drafts in zip(seqs, proposed):
        row = _next_row(scheduler, seq, drafts)
        if row is None:
            return None
        rows.append(row)
    if not any(rows) or sum(1 + len(row) for row in rows) > scheduler.max_num_batched_tokens:
        return None  # nothing proposed: a multi-step round decodes the next tokens for less
    if not _allocate(scheduler, seqs, [1 + len(d) for d in proposed], rows):
        return None
    return _continuation_output(scheduler, in_flight, rows)


def _allocate(scheduler: Scheduler, seqs: list[Sequence], ahead: list[int], rows: list[list[int]]) -> bool:
    """Slots for every row, from where the step in flight leaves it (``allocate_spans``)."""
    spans = [(seq.num_computed_tokens + n, 1 + len(row)) for seq, n, row in zip(seqs, ahead, rows)]
    return allocate_spans(scheduler, seqs, spans)


def allocate_spans(scheduler: Scheduler, seqs: list[Sequence], spans: list[tuple[int, int]]) -> bool:
    """Slots for each sequence's span (its first position, its tokens) planned ahead of a step, if they leave the
    watermark free (as a normal step's proposals must: they never push a request out) and need no copy-on-write
    copy; blocks appended before a refusal stay with their sequences (they fill as it grows)."""
    bm = scheduler.block_manager
    needed = sum(bm.num_new_blocks_needed(seq.seq_id, start, start + n) for seq, (start, n) in zip(seqs, spans))
    if bm.num_free_blocks - needed < bm.watermark_blocks:
        return False
    for seq, (start, n) in zip(seqs, spans):
        planned = bm.allocate_slots(seq.seq_id, start, n)
        if planned is None or planned:  # a shared block: a normal step copies it
            if planned:
                bm.undo_copies(seq.seq_id, planned)
            return False
    return True


def _next_row(scheduler: Scheduler, seq: Sequence, drafts: list[int]) -> list[int] | None:
    """The proposals of ``seq``'s row in the successor, or None when it cannot run."""
    params, drafter = seq.params, scheduler.drafter
    assert drafter is not None
    max_len = scheduler.max_model_len
    if params.max_tokens is not None:
        max_len = min(max_len, seq.num_prompt_tokens + params.max_tokens)
    held = len(seq.token_ids) + len(drafts)  # its tokens once the step in flight took every proposal
    room = min(drafter.k, max_len - held - 2, scheduler.max_num_batched_tokens - 1)
    if room < 0:
        return None  # it ends in the step in flight, or with the model's own token after it
    return lookup_after(drafter.proposer, seq, drafts, room) if drafter.speculates(seq, len(drafts) + 1) else []


def lookup_after(proposer: Proposer, seq: Sequence, drafts: list[int], room: int) -> list[int]:
    """Proposals after ``seq``'s tokens, its ``drafts`` and the token that will follow them, guessed as the
    lookup's first: ``room`` at most. Prompt lookup reads the sequence's kept array with the guesses after it
    (``propose_ahead``); another proposer is asked with the guesses in its list, without the sequence's id."""
    if room <= 0:
        return []
    if isinstance(proposer, NgramProposer):
        first = proposer.propose_ahead(seq.token_ids, drafts, 1, seq.seq_id)
        return proposer.propose_ahead(seq.token_ids, drafts + first, room, seq.seq_id) if first else []
    first = proposer.propose(seq.token_ids + drafts, 1)
    return proposer.propose(seq.token_ids + drafts + first, room) if first else []


def _continuation_output(scheduler: Scheduler, in_flight: SchedulerOutput, rows: list[list[int]]) -> SchedulerOutput:
    """The successor's step: each row fed first the greedy token of its last logits row in ``in_flight``
    (``first_from``: on the device, not known here), then its proposals."""
    seqs, proposed = in_flight.seqs, in_flight.batch.draft_token_ids or []
    last_rows, offset = [], 0
    for drafts in proposed:  # in_flight's logits: 1 + len(drafts) rows a sequence, in order
        offset += 1 + len(drafts)
        last_rows.append(offset - 1)
    bm = scheduler.block_manager
    batch = ScheduledBatch(
        input_token_ids=[t for row in rows for t in [0, *row]],  # each first token on the device
        num_computed_tokens=[seq.num_computed_tokens + 1 + len(d) for seq, d in zip(seqs, proposed)],
        num_scheduled_tokens=[1 + len(row) for row in rows],
        block_tables=[bm.get_block_table(seq.seq_id) for seq in seqs],
        sampling_rows=list(range(len(seqs))),
        lora_requests=[seq.request.lora_request for seq in seqs] if scheduler.max_loras is not None else None,
        draft_token_ids=rows,
        first_from=last_rows,
    )
    return SchedulerOutput(batch, list(seqs), list(seqs))


def stale_rows(output: SchedulerOutput) -> list[int]:
    """The rows of a chained verifying step whose sequence did not take every proposal of the step before: the
    positions they ran at are not the sequence's. Empty for any other step."""
    if output.batch.first_from is None:
        return []
    computed = output.batch.num_computed_tokens
    return [row for row, seq in enumerate(output.seqs) if seq.num_computed_tokens != computed[row]]


def has_live_rows(output: SchedulerOutput) -> bool:
    """Whether a queued step still has a row to read: one neither ended (or aborted) nor stale."""
    stale = set(stale_rows(output))
    return any(not seq.status.finished and row not in stale for row, seq in enumerate(output.seqs))
