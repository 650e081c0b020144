"""Multi-step rounds: several greedy decode steps run back to back on the device, read by the host at the end
(or a step at a time by a stream: ``engine/round_reader.py``).

A round suits a batch where every sequence decodes one token greedily without penalties, logits processors,
logprobs, kept logits or a ``min_tokens`` barrier: each step's argmax can feed the next forward on the device
and be checked for stops afterwards. A grammar's mask needs the previous token on the host: the worker reads
each step's tokens while the next forward runs (worker/structured_output.py), on one device only (other
tensor-parallel ranks would choose their tokens unmasked). The first token of a request goes out alone (time to
first token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged_backend.core.block_manager import BlockManager
from paged_backend.core.scheduler_output import BlockMoves, ScheduledBatch, SchedulerOutput
from paged_backend.core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from paged_backend.core.scheduler import Scheduler


def can_run_ahead(seq: Sequence, grammar_rounds: bool) -> bool:
    params = seq.params
    return (
        seq.num_uncomputed_tokens == 1
        and seq.num_output_tokens > 0
        and params.greedy
        and not params.has_penalties
        and not params.logits_processors
        and params.logprobs is None
        and not seq.request.keep_logits
        and seq.num_output_tokens >= params.min_tokens
        # a grammar's mask and a logit bias are the round's rank-0 state: rounds only where one worker runs
        and (grammar_rounds or (seq.grammar is None and not params.logit_bias))
    )


def _steps_left(seq: Sequence, ahead: int, max_steps: int, max_model_len: int) -> int:
    """Steps a sequence may still take once ``ahead`` more tokens are in: what ``max_tokens`` and
    ``max_model_len`` leave it, at most ``max_steps`` (0: it ends within those tokens)."""
    left = max_model_len - len(seq.token_ids) - ahead
    if seq.params.max_tokens is not None:
        left = min(left, seq.params.max_tokens - seq.num_output_tokens - ahead)
    return max(0, min(max_steps, left))


def _few_idle(steps: list[int]) -> bool:
    """A round runs max(steps) forwards for the whole batch: not worth it when most rows would idle."""
    return 2 * sum(steps) >= max(steps) * len(steps)


def plan_round(
    seqs: list[Sequence],
    num_new_tokens: list[int],
    max_steps: int,
    max_model_len: int,
    block_manager: BlockManager,
    grammar_rounds: bool = True,
) -> tuple[list[int] | None, BlockMoves]:
    """How many steps each sequence takes in one round (None: a normal step), and the copy-on-write copies its
    extra slots need. A sequence takes no more steps than ``max_tokens`` and ``max_model_len`` leave it, nor more
    than the blocks it can get hold."""
    if not seqs or any(n != 1 for n in num_new_tokens) or not all(can_run_ahead(seq, grammar_rounds) for seq in seqs):
        return None, []
    steps: list[int] = []
    copies: BlockMoves = []
    for seq in seqs:
        n = max(1, _steps_left(seq, 0, max_steps, max_model_len))
        if n > 1:
            planned = block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, n)
            if planned is None:  # no free blocks for all n: as many steps as its blocks already hold
                n = max(1, min(n, _capacity(seq, block_manager) - seq.num_computed_tokens))
            else:
                copies += planned
        steps.append(n)
    return (steps if max(steps) > 1 and _few_idle(steps) else None), copies


def plan_continuation(
    seqs: list[Sequence],
    num_steps: list[int],
    max_steps: int,
    max_model_len: int,
    block_manager: BlockManager,
) -> tuple[list[int], list[int]] | None:
    """The round after the one in flight (where ``seqs`` take ``num_steps``), planned before that round's tokens
    are known, as if none of them stops there: (its rows' indices in that round, their steps), or None when it
    cannot go ahead. A row that ends at that round's length limit is left out; one that a stop token ends there is
    computed for nothing. Rows needing a copy-on-write copy or a block that is not free stop it (a normal step
    copies or preempts once the tokens are known)."""
    if any(seq.grammar is not None or not can_run_ahead(seq, False) for seq in seqs):
        return None  # a grammar's mask needs the previous token on the host
    rows: list[int] = []
    steps: list[int] = []
    for row, (seq, ahead) in enumerate(zip(seqs, num_steps)):
        n = _steps_left(seq, ahead, max_steps, max_model_len)
        if n == 0:
            continue  # it ends in the round in flight
        start = seq.num_computed_tokens + ahead
        planned = block_manager.allocate_slots(seq.seq_id, start, n)
        if planned is None:  # no free blocks for all n: as many steps as its blocks already hold
            n = min(n, _capacity(seq, block_manager) - start)
            planned = block_manager.allocate_slots(seq.seq_id, start, n) if n > 0 else None
        if planned is None or planned:
            if planned:
                block_manager.undo_copies(seq.seq_id, planned)
            return None
        rows.append(row)
        steps.append(n)
    return (rows, steps) if rows and _few_idle(steps) else None


def continuation(scheduler: Scheduler, in_flight: SchedulerOutput, read: int = 0) -> SchedulerOutput | None:
    """The multi-step round that follows ``in_flight`` (a round queued on the device, its tokens not read yet, or
    only its first ``read`` steps' when a stream reads it a step at a time),
    for async scheduling: its sequences again, each from the token that round ends with (its rows read
    ``prev_rows``), planned as if none stops there (``plan_continuation``). None when the next step must be a
    normal one: a request is swapped out or must run alone, a waiting request could take a place (the batch is
    not full, or a row ends in the round in flight), the batch would change, or a row needs what only a normal
    step does (a sample speculative decoding proposes for next, unless ``DraftPlanner.runs_ahead``, or one whose
    pause a guess may end: ``DraftPlanner.holds_round``)."""
    num_steps = in_flight.batch.num_steps
    if num_steps is None or scheduler.swapped or scheduler.run_alone:
        return None
    if scheduler.waiting and len(scheduler.running) < scheduler.max_num_seqs:
        return None  # a waiting request may get a place: the next step admits it
    live = [row for row, seq in enumerate(in_flight.seqs) if seq.status is SequenceStatus.RUNNING]
    if len(live) != len(scheduler.running):
        return None  # a sequence that did not run in that round would wait
    drafter = scheduler.drafter
    if drafter is not None and drafter.active(len(live)):
        seqs = [in_flight.seqs[row] for row in live if drafter.speculates(in_flight.seqs[row], num_steps[row])]
        if not all(drafter.runs_ahead(seq) for seq in seqs):
            return None  # a sample is proposed for after that round: its proposals need the round's tokens
        if drafter.holds_round([in_flight.seqs[row] for row in live]):
            return None  # a paused sample's guess is checked against that round's tokens: taken, it resumes
    bm = scheduler.block_manager
    plan = plan_continuation(
        [in_flight.seqs[row] for row in live],
        [max(0, num_steps[row] - read) for row in live],
        scheduler.num_scheduler_steps,
        scheduler.max_model_len,
        bm,
    )
    if plan is None:
        return None
    rows = [live[i] for i in plan[0]]
    if scheduler.waiting and len(rows) < len(live):
        return None  # a row ends at its length in the round in flight: its place goes to a waiting request
    return continuation_output(in_flight, rows, plan[1], bm, scheduler.max_loras is not None, read)


def continuation_output(
    in_flight: SchedulerOutput,
    rows: list[int],
    steps: list[int],
    block_manager: BlockManager,
    lora: bool,
    read: int = 0,  # steps of ``in_flight`` already counted
) -> SchedulerOutput:
    """The queued round's step: ``in_flight``'s rows ``rows`` again, from the positions that round leaves them
    at, each first fed the last token it sampled there (``prev_rows``: on the device, not known here)."""
    seqs = [in_flight.seqs[row] for row in rows]
    ahead = in_flight.batch.num_steps or []
    batch = ScheduledBatch(
        input_token_ids=[0] * len(seqs),  # not known yet: the device has them (prev_rows)
        num_computed_tokens=[seq.num_computed_tokens + max(0, ahead[row] - read) for seq, row in zip(seqs, rows)],
        num_scheduled_tokens=[1] * len(seqs),
        block_tables=[block_manager.get_block_table(seq.seq_id) for seq in seqs],
        sampling_rows=list(range(len(seqs))),
        num_steps=steps,
        lora_requests=[seq.request.lora_request for seq in seqs] if lora else None,
        prev_rows=rows,
    )
    return SchedulerOutput(batch, seqs, list(seqs))


def _capacity(seq: Sequence, block_manager: BlockManager) -> int:
    return len(block_manager.get_block_table(seq.seq_id)) * block_manager.block_size
