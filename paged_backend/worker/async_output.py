"""A step's output before the host has read it: vLLM v1's ``AsyncModelRunnerOutput``.

A multi-step round's tokens stay on the device until ``get_output``: they are copied into pinned host memory
behind the round's last step and an event marks the copy, so reading them waits for that round only, not for
a round queued behind it (async scheduling). A single step samples on the host when its output is read
(``DeferredOutput``): its forward runs on the device meanwhile, while the host finishes the step before it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from paged_backend.core.scheduler_output import ModelRunnerOutput
from paged_backend.worker.structured_output import RoundGrammars

# A round's forwards still queued when the host decides what follows it (``wait_for_last_steps``): the device runs
# them while the host plans and launches the next round, so it does not idle; a request that arrives before then
# is admitted right after this round instead of after the next.
LAST_STEPS = 2


def last_steps_begin(num_forwards: int) -> int:
    """The forward of a round before which its last ``LAST_STEPS`` begin (0 for a round that short)."""
    return max(0, num_forwards - LAST_STEPS)


class AsyncModelRunnerOutput(Protocol):
    def get_output(self) -> ModelRunnerOutput:
        """The step's output; waits for the device when it has not finished the step yet."""
        ...

    def wait_for_last_steps(self) -> None:
        """Returns once the device has only the step's last ``LAST_STEPS`` forwards left to run: a multi-step
        round's (``PendingRound``); any other step returns at once."""
        ...


class ReadyOutput:
    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def get_output(self) -> ModelRunnerOutput:
        return self.output

    def wait_for_last_steps(self) -> None:
        return None


class DeferredOutput:
    """A single step whose forward is queued: ``sample`` (the sampler on its logits, on the host) runs at the
    first ``get_output``. The logits may be a CUDA graph's output buffer, which the next replay overwrites: the
    model runner calls ``keep`` before it launches another step, in case this one was not read (or is dropped
    unread)."""

    def __init__(self, sample: Callable[[torch.Tensor], ModelRunnerOutput], logits: torch.Tensor) -> None:
        self._sample = sample
        self._logits: torch.Tensor | None = logits
        self._output: ModelRunnerOutput | None = None

    def keep(self) -> None:
        """Copy the logits out of a buffer that the next launch may overwrite (queued before it: same stream)."""
        if self._logits is not None:
            self._logits = self._logits.clone()

    def get_output(self) -> ModelRunnerOutput:
        if self._output is None:
            assert self._logits is not None
            self._output, self._logits = self._sample(self._logits), None
        return self._output

    def wait_for_last_steps(self) -> None:
        return None


class PendingRound:
    """A queued round's sampled tokens and their logprobs, ``[K, B]`` each on the device; row ``i`` keeps its
    first ``num_steps[i]``. A tensor-parallel rank other than 0 samples nothing: its output is empty."""

    def __init__(
        self,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        num_steps: list[int],
        grammars: RoundGrammars | None,
        sampling: bool,
        last_steps: torch.cuda.Event | None = None,  # recorded before the round's last LAST_STEPS forwards
    ) -> None:
        self.num_steps, self.grammars, self.last_steps = num_steps, grammars, last_steps
        self.host: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None
        if sampling:  # one copy for both (token ids < 2**53 are exact in float64)
            both = torch.stack([tokens.double(), logprobs.double()])  # [2, K, B]
            on_gpu = both.device.type == "cuda"
            self.host = torch.empty(both.shape, dtype=both.dtype, pin_memory=on_gpu)
            self.host.copy_(both, non_blocking=on_gpu)
            if on_gpu:
                self.event = torch.cuda.Event()
                self.event.record(torch.cuda.current_stream(both.device))

    def wait_for_last_steps(self) -> None:
        if self.last_steps is not None:
            self.last_steps.synchronize()

    def get_output(self) -> ModelRunnerOutput:
        if self.host is None:
            return ModelRunnerOutput()
        if self.event is not None:
            self.event.synchronize()
        token_rows, logprob_rows = self.host.tolist()  # [K][B] each
        steps = self.num_steps
        sampled = [[int(t) for t in row[:n]] for row, n in zip(zip(*token_rows), steps)]  # row i's first steps[i]
        return ModelRunnerOutput(
            sampled,
            [list(row[:n]) for row, n in zip(zip(*logprob_rows), steps)],
            grammars=[] if self.grammars is None else self.grammars.advanced(sampled),
        )
