"""A multi-step round read a step at a time, for streams: each ``LLMEngine.step()`` call hands out one forward's
tokens as soon as the device has run it, where a round read whole would hold them back until its last forward
(a stream would get them in bursts of ``num_scheduler_steps``).

Only where someone streams (``finished_only`` false), with async scheduling, for rounds without a grammar (its
state advances by whole rounds) and without a drafter (it observes whole steps). The round after it is planned once
its last ``LAST_STEPS`` forwards are left, as ``queue_next`` plans it for a round read whole, counting only the
round's steps not read yet as ahead. Each read counts its tokens (``update_from_output`` takes one a row; a row
that takes fewer steps gets none), so stops, aborts and failures see exactly the tokens handed out so far.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from paged_backend.core.scheduler_output import SchedulerOutput
from paged_backend.core.sequence import Request, SequenceStatus
from paged_backend.engine.step_failures import StepError, step_failed
from paged_backend.outputs import RequestOutput
from paged_backend.worker.async_output import AsyncModelRunnerOutput, PendingRound, last_steps_begin

if TYPE_CHECKING:
    from paged_backend.engine.llm_engine import LLMEngine


@dataclass
class Reading:
    """A round being handed out a step at a time: its step, its queued output and how many steps are out."""

    scheduler_output: SchedulerOutput
    pending: PendingRound
    read: int = 0


def round_to_read(
    engine: LLMEngine, scheduler_output: SchedulerOutput, pending: AsyncModelRunnerOutput, finished_only: bool
) -> Reading | None:
    """The round to read a step at a time, if this step is one (see the module's docstring)."""
    if finished_only or not engine.async_scheduling or engine.scheduler.drafter is not None:
        return None
    if not isinstance(pending, PendingRound) or pending.grammars is not None:
        return None
    return Reading(scheduler_output, pending)


def unfinished(current: Reading | None) -> Reading | None:
    """The round being read, unless every row of it has ended (or was aborted): then the rest is dropped unread."""
    if current is None or all(seq.status.finished for seq in current.scheduler_output.seqs):
        return None
    return current


def read_round_step(engine: LLMEngine, owners: list[Request], finished_only: bool) -> list[RequestOutput]:
    """Hand out the next step of ``engine._reading``; plan the round after it when its last forwards are
    left; once its last step is read (or every row has ended), the engine steps on as after a round read whole."""
    current = engine._reading
    assert current is not None
    output, pending = current.scheduler_output, current.pending
    # with arrivals (an engine loop), the next round is planned once this one's last forwards are left, so that
    # a request arriving meanwhile is not queued behind it; else at once, which leaves the host the most time
    begin = last_steps_begin(pending.num_forwards) if engine.arrivals is not None else 0
    try:
        if current.read == begin:
            engine._in_flight = engine._queue_next((output, pending), current.read)
        runner_output = pending.read_step(current.read)
    except Exception as error:  # this step's tokens were not taken: its requests are redone, or fail
        engine._in_flight = engine._reading = None
        failed = step_failed(engine, owners, error, retry=True)
        if failed:
            raise StepError(failed, error) from error
        return []
    current.read += 1
    try:
        updates = engine.scheduler.update_from_output(output, runner_output)
        for hit in engine.output_processor.process_tokens(updates):
            engine.scheduler.finish_seq(hit.seq, SequenceStatus.FINISHED_STOPPED, hit.stop, hit.num_tokens)
        engine._reading = unfinished(current) if current.read < pending.num_forwards else None
        if engine._reading is None and engine._in_flight is None:  # read, or nobody is left to read it for
            engine._in_flight = engine._queue_following()
        engine._in_flight = engine._live_in_flight()
        return engine.output_processor.make_outputs(updates, finished_only)
    except Exception as error:
        engine._in_flight = engine._reading = None
        raise StepError(step_failed(engine, owners, error, retry=False), error) from error
