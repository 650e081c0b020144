"""What a failed step takes down: the requests held responsible fail, the others of a failed forward are redone
alone, and an error the device cannot recover from stops everything."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from paged_backend.core.scheduler_output import SchedulerOutput
from paged_backend.core.sequence import Request

if TYPE_CHECKING:
    from paged_backend.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class StepError(RuntimeError):
    """A step raised, and the requests held responsible (``request_ids``) were aborted; the others are intact (or
    being redone) and the engine can step on. The original error is ``__cause__``."""

    def __init__(self, request_ids: list[str], error: Exception) -> None:
        super().__init__(f"a step running request(s) {request_ids} failed: {error!r}")
        self.request_ids = request_ids


def step_owners(engine: LLMEngine, scheduler_output: SchedulerOutput) -> list[Request]:
    """Whom a failure of the step takes down: not a request that ended before a queued round is read (nor one
    added since under its id)."""
    return [r for r in scheduler_output.touched_requests() if engine.requests.get(r.request_id) is r]


def step_failed(engine: LLMEngine, owners: list[Request], error: Exception, retry: bool) -> list[str]:
    """A step raised. Unrecoverable (the device's own error): raise it. Else the requests it touched (``owners``)
    are suspects. A step of one request, or a second failure of a request, fails that request (``StepError``); the
    others of a failed forward are redone alone (``Scheduler.retry_alone``), so that a request that makes steps
    fail takes no neighbour down with it, while a passing fault costs its batch only a recompute. A failure after
    the forward (sampled tokens partly taken) fails every request it touched. Returns the ids of the requests that
    failed (aborted)."""
    if not engine.executor.is_recoverable(error):
        raise error
    for request in owners:
        request.num_failed_steps += 1
    if retry and len(owners) > 1:
        failed = [r.request_id for r in owners if r.num_failed_steps > 1]
        for request in owners:
            if request.num_failed_steps == 1 and not request.finished:
                engine.scheduler.retry_alone(request)
    else:  # those that finished in the step too: their final output was never made
        failed = [r.request_id for r in owners]
    logger.warning(
        "a step of %d request(s) failed (%r): %d fail, any others are redone alone",
        len(owners),
        error,
        len(failed),
        exc_info=error,
    )
    engine.abort_request(failed, cache_blocks=False)
    return failed
