"""Async scheduling's queue of one: the next step launched on the device before the engine has made this step's
outputs, so that its forward runs while the host turns tokens into text (``LLMEngine.step`` reads it next).

Two moments to launch it: right after a multi-step round or a verifying step is launched, the step that continues
it (its tokens not known yet: ``queue_next``; a verifying step's successor on the guess that every proposal is
taken, core/spec_chain.py); otherwise once this step's tokens are counted (``queue_following``). Either way a row
that a stop string, a stop token or an abort ends meanwhile, or that turns out stale, is computed for nothing and
skipped when read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from paged_backend.core.scheduler import Scheduler
from paged_backend.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from paged_backend.worker.async_output import AsyncModelRunnerOutput
from paged_backend.worker.worker import Executor

logger = logging.getLogger(__name__)

InFlight = tuple[SchedulerOutput, AsyncModelRunnerOutput]  # a step queued on the device
Arrivals = Callable[[], bool]  # whether requests wait to be added to the engine (``LLMEngine.arrivals``)


class FailedLaunch:
    """A queued step whose launch raised: reading it raises the same error, so the step that reads it fails as
    it would have failed launching it itself."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def get_output(self) -> ModelRunnerOutput:
        raise self.error

    def wait_for_last_steps(self) -> None:
        return None


def admits_arrivals(scheduler: Scheduler, arrivals: Arrivals | None) -> bool:
    """Whether requests wait to be added and the next step could take one (the batch is not full)."""
    return arrivals is not None and arrivals() and len(scheduler.running) < scheduler.max_num_seqs


def queue_following(scheduler: Scheduler, executor: Executor, arrivals: Arrivals | None) -> InFlight | None:
    """The next step, scheduled and launched as soon as this one's tokens are counted; None while requests wait to
    be added that it could take (the step after them schedules with them)."""
    if admits_arrivals(scheduler, arrivals):
        return None
    following = scheduler.schedule()
    if following.is_empty:
        return None
    try:
        return following, executor.execute_model_async(following)
    except Exception as error:
        return following, FailedLaunch(error)


def queue_next(
    scheduler: Scheduler,
    executor: Executor,
    in_flight: InFlight,
    arrivals: Arrivals | None,
    read: int = 0,  # steps of the round in flight already counted (``round_reader``)
) -> InFlight | None:
    """The round after ``in_flight`` (a round whose tokens are not read yet), when the scheduler plans one
    (``Scheduler.schedule_continuation``). If queueing it fails, the next step is a normal one, which runs the
    same tokens again (and reports its own error, if any).

    With ``arrivals`` (an engine that takes requests while it steps), the decision waits until the round in flight
    has only its last forwards left (``wait_for_last_steps``), and there is no continuation if requests arrived
    meanwhile that the batch has room for: they are admitted right after this round, not after the next one too
    (time to first token). A verifying step has no last forwards to wait for: its successor is decided at its
    launch, and a request that arrives during it waits for the successor too (one verifying step more)."""
    if isinstance(in_flight[1], FailedLaunch):
        return None  # the step it would follow never ran
    if arrivals is not None:
        in_flight[1].wait_for_last_steps()
        if admits_arrivals(scheduler, arrivals):
            return None
    continuation = scheduler.schedule_continuation(in_flight[0], read)
    if continuation is None:
        return None
    try:
        return continuation, executor.execute_model_async(continuation)
    except Exception as error:
        if not executor.is_recoverable(error):
            raise
        logger.warning("queueing the next round failed (%r): the next step schedules anew", error, exc_info=error)
        return None
