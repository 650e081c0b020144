"""A step's output before the host has read it: vLLM v1's ``AsyncModelRunnerOutput``.

A multi-step round's tokens are copied into pinned host memory behind each of its steps on a GPU, an event
marking each copy (behind its last step elsewhere), so reading them waits for that round only, not for a round
queued behind it (async scheduling), and a stream can read them a step at a time (``read_step``). A single step
samples on the host when its output is read (``DeferredOutput``): its forward runs on the device meanwhile,
while the host finishes the step before it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from paged_backend.core.scheduler_output import ModelRunnerOutput
from paged_backend.kernels.greedy import greedy_tokens
from paged_backend.worker.step_inputs import queued_copy
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

    def greedy_rows(self, rows: list[int]) -> torch.Tensor:
        """The greedy token of each of the logits ``rows``, queued on the device before the step is read: a chained
        verifying step's first inputs (core/spec_chain.py)."""
        if self._logits is None:
            raise RuntimeError("a chained verifying step must be launched before the step it follows is read")
        return greedy_tokens(self._logits[queued_copy(torch.tensor(rows), self._logits.device)])[0]

    def get_output(self) -> ModelRunnerOutput:
        if self._output is None:
            assert self._logits is not None
            self._output, self._logits = self._sample(self._logits), None
        return self._output

    def wait_for_last_steps(self) -> None:
        return None


class StepCopies:
    """A round's tokens and logprobs copied to pinned host memory step by step, an event behind each step's copy:
    a step's tokens can be read as soon as it has run, while the round's later steps still run."""

    def __init__(self, num_forwards: int, num_rows: int) -> None:
        # [K, 2, B]: a step's copy lands in one contiguous piece of pinned memory (a strided target would make
        # the copy go through pageable memory and wait for the device)
        self.host = torch.empty(num_forwards, 2, num_rows, dtype=torch.float64, pin_memory=True)
        self.events: list[torch.cuda.Event] = []

    def add(self, token: torch.Tensor, logprob: torch.Tensor) -> None:
        """Queue step ``len(events)``'s copy (token ids < 2**53 are exact in float64)."""
        self.host[len(self.events)].copy_(torch.stack([token.double(), logprob.double()]), non_blocking=True)
        self.events.append(torch.cuda.Event())
        self.events[-1].record(torch.cuda.current_stream(token.device))


class PendingRound:
    """A queued round's sampled tokens and their logprobs, ``[K, B]`` each on the device; row ``i`` keeps its
    first ``num_steps[i]``. A tensor-parallel rank other than 0 samples nothing: its output is empty. Read whole
    (``get_output``) or a step at a time (``read_step``)."""

    def __init__(
        self,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        num_steps: list[int],
        grammars: RoundGrammars | None,
        sampling: bool,
        last_steps: torch.cuda.Event | None = None,  # recorded before the round's last LAST_STEPS forwards
        copies: StepCopies | None = None,  # on a GPU: its steps' copies, already queued
    ) -> None:
        self.num_steps, self.grammars, self.last_steps = num_steps, grammars, last_steps
        self.host: torch.Tensor | None = None
        self.events: list[torch.cuda.Event] = []  # one a step, or one for the whole round
        if sampling and copies is not None:
            self.host, self.events = copies.host, copies.events
        elif sampling:  # one copy for both (token ids < 2**53 are exact in float64)
            both = torch.stack([tokens.double(), logprobs.double()], dim=1)  # [K, 2, B]
            on_gpu = both.device.type == "cuda"
            self.host = torch.empty(both.shape, dtype=both.dtype, pin_memory=on_gpu)
            self.host.copy_(both, non_blocking=on_gpu)
            if on_gpu:
                self.events = [torch.cuda.Event()]
                self.events[0].record(torch.cuda.current_stream(both.device))

    @property
    def num_forwards(self) -> int:
        """The round's forwards: as many as its longest row's steps."""
        return max(self.num_steps)

    def read_step(self, step: int) -> ModelRunnerOutput:
        """Step ``step``'s tokens, once it has run: one a row that takes the step, none for the others. Not for a
        round under a grammar (its state advances by whole rounds)."""
        assert self.grammars is None, "a round under a grammar is read whole"
        if self.host is None:
            return ModelRunnerOutput()
        if self.events:
            self.events[min(step, len(self.events) - 1)].synchronize()
        tokens, logprobs = self.host[step].tolist()  # [B] each
        takes = [n > step for n in self.num_steps]
        return ModelRunnerOutput(
            [[int(t)] if take else [] for t, take in zip(tokens, takes)],
            [[p] if take else [] for p, take in zip(logprobs, takes)],
        )

    def wait_for_last_steps(self) -> None:
        if self.last_steps is not None:
            self.last_steps.synchronize()

    def get_output(self) -> ModelRunnerOutput:
        if self.host is None:
            return ModelRunnerOutput()
        if self.events:
            self.events[-1].synchronize()
        token_rows, logprob_rows = self.host.transpose(0, 1).tolist()  # [K][B] each
        steps = self.num_steps
        sampled = [[int(t) for t in row[:n]] for row, n in zip(zip(*token_rows), steps)]  # row i's first steps[i]
        return ModelRunnerOutput(
            sampled,
            [list(row[:n]) for row, n in zip(zip(*logprob_rows), steps)],
            grammars=[] if self.grammars is None else self.grammars.advanced(sampled),
        )
