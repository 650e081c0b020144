"""The draft model of speculative decoding (``method: draft_model``, HF's ``assistant_model``): after each step it
reads what the target computed and guesses the next k tokens of every row that will be proposed for.

The draft keeps a paged KV cache of its own, block for block beside the target's: the scheduler's block tables
and cache moves serve both, so prefix hits, preemption (by swapping or recomputing), forks and chunked prefill
keep the draft's KV as they keep the target's, and the scheduler stays the only owner of blocks. When a step is
read, the draft runs, batched, over the tokens each row had computed by the target in it (a prefill chunk, a
decode token, a round's tokens, a verified row's last token and the proposals it took) — its KV stays level with
the target's — and, for a row to be proposed for, its newest token too, whose logits give the first guess. Then
k - 1 forwards of one token a row, each fed the guess before. The guesses' KV lies past the row's blocks: it goes
to scratch blocks past the scheduler's (the draft's own), and the next step writes the row's real tokens over it
in its own blocks. Guesses are greedy; the target verifies every one, so a wrong guess (or a draft KV that is
off, as after a failed draft pass, whose rows are guessed from stale KV until their blocks are rewritten) costs
speed, never the output.

On a GPU both kinds of forward replay CUDA graphs, as the target's decode steps do (launching a small model's
layers from Python costs more than running them): the catch-up forward with its rows padded to ``catch_up_len``
tokens (a verified row feeds its first token, the k - 1 it took before the last and the last: k + 2; a
multi-step round's row its steps' tokens and the last: steps + 1; prefill chunks run eagerly), and the k - 1
guessing forwards as decode steps.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from transformers import PreTrainedModel

from paged_backend.core.scheduler_output import ModelRunnerOutput, ScheduledBatch, SchedulerOutput
from paged_backend.core.spec_decode import speculates
from paged_backend.worker.async_output import AsyncModelRunnerOutput
from paged_backend.worker.attention import AttentionMetadata, PagedAttentionSwitch
from paged_backend.worker.cache_engine import CacheEngine, KVCacheSpec
from paged_backend.worker.cuda_graphs import CUDAGraphRunner
from paged_backend.worker.hf_forward import hf_forward, takes_logits_to_keep
from paged_backend.worker.step_inputs import StepInputs, advance_decode_inputs, build_step_inputs
from paged_backend.worker.verify_inputs import pad_rows
from paged_backend.worker.weights import WeightAddresses

logger = logging.getLogger(__name__)


class DraftRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        spec: KVCacheSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        num_cpu_blocks: int,
        num_speculative_tokens: int,
        max_rows: int,  # rows guessed for in one step at most: a larger batch gets no proposals
        max_positions: int,  # max_model_len: no guess is placed at or past it
        round_steps: int = 1,  # num_scheduler_steps: the tokens a multi-step round computes a row
        use_graphs: bool = False,  # CUDA graphs for its forwards (a GPU, unless enforce_eager)
    ) -> None:
        self.model, self.device, self.block_size = model, device, block_size
        self.max_positions = max_positions
        self.k, self.max_rows, self.num_blocks = num_speculative_tokens, max_rows, num_blocks
        # a row's guesses reach k tokens past its last scheduled one, past its blocks by at most this many
        self.scratch_per_row = math.ceil(num_speculative_tokens / block_size) + 1
        total = num_blocks + max_rows * self.scratch_per_row
        self.cache_engine = CacheEngine(spec, total, block_size, device, num_cpu_blocks)
        self.cache_engine.swap_space.caches()  # the draft's share, allocated now: before any graph is captured
        self.switch = PagedAttentionSwitch(model, self.cache_engine.kv_caches)
        self.keeps_logits = takes_logits_to_keep(model)
        self.width = math.ceil(max_positions / block_size) + self.scratch_per_row  # blocks a row's table holds
        self.use_graphs = use_graphs
        self.guess_graphs: CUDAGraphRunner | None = None  # the guessing forwards (one token a row)
        self.catch_up_len = max(num_speculative_tokens + 2, round_steps + 1)  # the tokens a row feeds at most
        self.catch_up_graphs: CUDAGraphRunner | None = None  # the first forward, rows padded to catch_up_len
        self.weights: WeightAddresses | None = None  # where the graphs read the weights

    def capture_graphs(self) -> None:
        """Capture both forwards' graphs. They read the draft's KV cache and weights at today's addresses: called
        once the target's runner is set up (its compile packs the weights of a draft that shares them) and again
        when a weight moved since. Where a capture fails, those forwards run eagerly."""
        if not self.use_graphs:
            return
        self.weights = WeightAddresses(self.model)
        with torch.inference_mode():
            self.guess_graphs = CUDAGraphRunner(
                self._graph_forward, self.max_rows, self.width, self.device, num_staging=max(1, self.k - 1)
            )
            self.catch_up_graphs = CUDAGraphRunner(
                self._graph_forward, self.max_rows, self.width, self.device, q_len=self.catch_up_len
            )
        for name in ("guess_graphs", "catch_up_graphs"):
            try:
                with torch.inference_mode(), self.switch:
                    getattr(self, name).capture()
            except Exception as exc:  # noqa: BLE001 - the draft still guesses, eagerly
                logger.warning("the draft model's CUDA graph capture (%s) failed (%s: %s); it runs eagerly", name,
                               type(exc).__name__, exc)  # fmt: skip
                setattr(self, name, None)

    def sleep(self) -> None:
        """Free the draft's KV cache and its graphs."""
        self.guess_graphs = self.catch_up_graphs = None
        self.cache_engine.release()

    def wake_up(self) -> None:
        self.cache_engine.restore()
        self.capture_graphs()

    def move_blocks(self, batch: ScheduledBatch) -> None:
        """The step's swaps and copies, as the target's cache makes them."""
        self.cache_engine.swap_out(batch.blocks_to_swap_out)
        self.cache_engine.swap_in(batch.blocks_to_swap_in)
        self.cache_engine.copy_blocks(batch.blocks_to_copy)

    @torch.inference_mode()
    def propose(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> list[list[int]]:
        """After the step: the draft's KV of every token the target computed in it, and k greedy guesses for
        each sample (a row per ``output.sampled_token_ids`` entry; [] for those not guessed for)."""
        batch, seqs = scheduler_output.batch, scheduler_output.seqs
        if self.weights is not None and self.weights.replaced() is not None:
            self.capture_graphs()
        sampled = dict(zip(batch.sampling_rows, output.sampled_token_ids))
        guessed = batch.num_seqs <= self.max_rows  # as the scheduler: no proposals in a large batch
        rows: list[tuple[int, list[int], list[int]]] = []  # (first position, tokens to feed, block table)
        batch_rows: list[int] = []  # the batch row of each
        guess_rows: list[int] = []  # of ``rows``, those guessed for
        for row, seq in enumerate(seqs):
            if seq.status.finished:  # aborted while the step ran: its blocks are no longer its own
                continue
            start, n = batch.num_computed_tokens[row], batch.num_scheduled_tokens[row]
            drafts = batch.draft_token_ids[row] if batch.draft_token_ids else []
            taken = sampled.get(row, [])
            feed = seq.token_ids[start : start + n - len(drafts)] + taken[:-1]  # what the target computed
            table = batch.block_tables[row]
            newest = start + len(feed)  # the position of the row's newest token; its guesses follow it
            if taken and guessed and newest + self.k - 1 < self.max_positions and speculates(seq, len(taken)):
                feed.append(taken[-1])
                scratch = self.num_blocks + len(guess_rows) * self.scratch_per_row
                table = table + list(range(scratch, scratch + self.scratch_per_row))
                guess_rows.append(len(rows))
            rows.append((start, feed, table))
            batch_rows.append(row)
        guesses = dict(zip(batch_rows, self._guess(rows, guess_rows))) if rows else {}
        # the samples forked this step (after the batch's sampling rows) are guessed for from their next step on
        return [guesses.get(row, []) for row in batch.sampling_rows] + [[]] * len(scheduler_output.fork_parents)

    def _guess(self, rows: list[tuple[int, list[int], list[int]]], guess_rows: list[int]) -> list[list[int]]:
        """One forward over every row's tokens, then k - 1 of the guessed rows' guesses; each row's guesses."""
        first = ScheduledBatch(
            input_token_ids=[token for _, feed, _ in rows for token in feed],
            num_computed_tokens=[start for start, _, _ in rows],
            num_scheduled_tokens=[len(feed) for _, feed, _ in rows],
            block_tables=[table for _, _, table in rows],
            sampling_rows=guess_rows,
        )
        logits = self._forward(build_step_inputs(first, self.block_size))
        if not guess_rows:
            return [[] for _ in rows]
        tokens = [logits.argmax(-1)]  # [R] each
        ahead = ScheduledBatch(  # each guessed row's first guess, at the position after its newest token
            input_token_ids=[0] * len(guess_rows),
            num_computed_tokens=[rows[r][0] + len(rows[r][1]) for r in guess_rows],
            num_scheduled_tokens=[1] * len(guess_rows),
            block_tables=[rows[r][2] for r in guess_rows],
            sampling_rows=list(range(len(guess_rows))),
        )
        inputs = build_step_inputs(ahead, self.block_size)
        steps = np.full(len(guess_rows), self.k - 1, dtype=np.int64)
        for j in range(self.k - 1):
            step = advance_decode_inputs(inputs, j, steps, self.block_size)
            tokens.append(self._forward(step, tokens[-1], staging_index=j).argmax(-1))
        columns = torch.stack(tokens, dim=1).tolist()  # [R][k]
        result: list[list[int]] = [[] for _ in rows]
        for r, guess in zip(guess_rows, columns):
            result[r] = [int(t) for t in guess]
        return result

    def _forward(
        self, inputs: StepInputs, input_ids: torch.Tensor | None = None, staging_index: int = 0
    ) -> torch.Tensor:
        """The logits of ``inputs.logits_indices``; ``input_ids`` [R] on the device (the guesses before) replace
        the inputs' token ids. A graph where one fits, else eagerly."""
        guess, catch_up = self.guess_graphs, self.catch_up_graphs
        if guess is not None and guess.can_run(inputs):
            with self.switch:
                return guess.run(inputs, input_ids, staging_index)
        if catch_up is not None and input_ids is None:
            padded = pad_rows(inputs, catch_up.q_len, self.block_size, self.width)
            if padded is not None and catch_up.can_run(padded[0]):
                with self.switch:
                    return catch_up.run(padded[0])[padded[1].to(self.device, non_blocking=True)]
        d = inputs.to(self.device)
        if input_ids is not None:
            d.input_ids = input_ids
        return self._graph_forward(d.input_ids, d.positions, d.metadata, d.logits_indices)

    def _graph_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, rows: torch.Tensor
    ) -> torch.Tensor:
        with self.switch:
            return hf_forward(self.model, self.keeps_logits, input_ids, positions, metadata, rows)


class ProposingOutput:
    """A step's output that, once read, carries the draft's guesses for the step after (``draft_token_ids``)."""

    def __init__(self, step: AsyncModelRunnerOutput, draft: DraftRunner, scheduler_output: SchedulerOutput) -> None:
        self.step, self.draft, self.scheduler_output = step, draft, scheduler_output
        self.output: ModelRunnerOutput | None = None

    def wait_for_last_steps(self) -> None:
        self.step.wait_for_last_steps()

    def get_output(self) -> ModelRunnerOutput:
        if self.output is None:
            output = self.step.get_output()
            if self.scheduler_output.seqs:  # rank 0's (speculative decoding runs on one device)
                try:
                    output.draft_token_ids = self.draft.propose(self.scheduler_output, output)
                except Exception:  # the draft's failure (out of memory, ...) costs guesses, never the step
                    logger.warning("the draft model failed: this step's samples get no proposals", exc_info=True)
            self.output = output
        return self.output
