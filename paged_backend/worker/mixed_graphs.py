"""CUDA graphs for steps that carry prompt tokens (prefill chunks, alone or beside decodes), up to a few hundred
tokens.

While prompts arrive, every running stream waits for the steps that prefill them. Run from Python, such a step of
the 8B shape spends about 20 ms launching its kernels whatever its size, while a few hundred tokens are about
10 ms of GPU work (docs/benchmarks.md, "Serving"): the launches, not the prefill, set the streams' longest gaps.
Replayed from a graph, the launches cost about a millisecond.

One graph per bucket of tokens (multiples of ``MIXED_STEP``, and the step budget), each with room for ``rows``
sequences (half its tokens, at most the decode graphs' largest batch) and as many logit rows. A step goes to the
smallest bucket that holds its tokens, sequences and logit rows, padded so:

- its own sequences first, unchanged;
- then sequences without tokens (``cu_seqlens_q`` repeats, context 0): the attention's programs for them find no
  query and write nothing;
- then one last sequence holding the padding tokens: slot -1 (no write), position 0, context 0 (no key is read,
  its outputs are zeros); each token's row is computed on its own, so these change no real token's result;
- logit rows past the step's own repeat its first one, and are dropped.

The grid of every kernel, attention's included (fixed by its tokens and sequences), is then the bucket's.
"""

from __future__ import annotations

import logging
import time

import torch

from paged_backend.worker.attention import AttentionMetadata
from paged_backend.worker.cuda_graphs import ForwardFn, capture_buckets
from paged_backend.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

MIXED_STEP = 64  # tokens between buckets: a step pads at most this many tokens
MIXED_MAX_TOKENS = 512  # beyond this a step's GPU work outlasts its launches: graphs gain little there


def mixed_capture_sizes(max_num_batched_tokens: int, max_tokens: int = MIXED_MAX_TOKENS) -> list[int]:
    """Token buckets: multiples of ``MIXED_STEP`` below the step budget (at most ``max_tokens``), then the budget
    itself, which the buffers every forward reads (LoRA's token slots, the all-reduce's) are sized for. None below
    4 tokens: a bucket of 1 or 2 would make dynamo specialise a dimension of size 1 (one logit row)."""
    top = min(max_tokens, max_num_batched_tokens)
    return [*range(MIXED_STEP, top, MIXED_STEP), top] if top >= 4 else []


class MixedGraphRunner:
    """Graphs of steps with prompt tokens, one per token bucket (see the module's docstring)."""

    def __init__(
        self,
        forward: ForwardFn,
        sizes: list[int],
        max_rows: int,
        max_blocks_per_seq: int,
        device: torch.device,
        batch_invariant: bool = False,
    ) -> None:
        if not sizes:
            raise ValueError("a mixed-step graph runner needs at least one token bucket")
        self.forward, self.device, self.batch_invariant = forward, device, batch_invariant
        self.sizes = sizes
        self.rows = {size: min(max_rows, size // 2) for size in sizes}  # sequences (and logit rows) a bucket holds
        tokens, rows = sizes[-1], max(self.rows.values())
        width = max(tokens, rows + 2)
        pin = device.type == "cuda"
        # Rows: input_ids, positions, slot_mapping (a column a token), context_lens, cu_seqlens_q, logits_indices
        # (a column a sequence): one copy from pinned memory moves them all, and the tables in a second.
        self.staging = torch.zeros(6, width, dtype=torch.long, pin_memory=pin)
        self.staging_tables = torch.zeros(rows + 1, max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
        self.copied = torch.cuda.Event() if pin else None  # when the staging buffers' last copy has run
        self.static_ints = torch.zeros(6, width, dtype=torch.long, device=device)
        self.static_tables = torch.zeros(rows + 1, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def bucket(self, inputs: StepInputs) -> int | None:
        """The smallest bucket that holds the step, or None."""
        t, b, n = inputs.num_tokens, inputs.num_seqs, inputs.logits_indices.shape[0]
        return next((s for s in self.sizes if s >= t and self.rows[s] >= max(b, n)), None)

    def can_run(self, inputs: StepInputs) -> bool:
        return bool(self.graphs) and inputs.num_tokens > 0 and self.bucket(inputs) is not None

    def _run(self, size: int) -> torch.Tensor:  # [rows, V]
        rows = self.rows[size]
        ids, pos, slots = self.static_ints[:3, :size]
        metadata = AttentionMetadata(
            slot_mapping=slots,
            block_tables=self.static_tables[: rows + 1],
            cu_seqlens_q=self.static_ints[4, : rows + 2].to(torch.int32),  # the cast is part of the graph
            context_lens=self.static_ints[3, : rows + 1],
            exact=self.batch_invariant,
        )
        return self.forward(ids, pos, metadata, self.static_ints[5, :rows])

    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool, each over a step of padding only."""
        start = time.perf_counter()
        prepare = lambda size: self._fill(size, _empty_step())  # noqa: E731 - no slot written, no key read
        self.graphs, self.outputs = capture_buckets(self.sizes, self._run, self.device, prepare)
        logger.info("captured %d CUDA graphs of steps with prompt tokens (up to %d tokens) in %.1f s",
                    len(self.sizes), self.sizes[-1], time.perf_counter() - start)  # fmt: skip

    def _fill(self, size: int, inputs: StepInputs) -> None:
        """The step, padded to the bucket, into the staging buffers, then queued to the static ones."""
        rows, staging = self.rows[size], self.staging
        t, b, n = inputs.num_tokens, inputs.num_seqs, inputs.logits_indices.shape[0]
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has read the staging buffers
        staging[0, :t], staging[0, t:size] = inputs.input_ids, 0
        staging[1, :t], staging[1, t:size] = inputs.positions, 0
        staging[2, :t], staging[2, t:size] = inputs.slot_mapping, -1
        staging[3, :b], staging[3, b : rows + 1] = inputs.context_lens, 0
        staging[4, : b + 1], staging[4, b + 1 : rows + 1], staging[4, rows + 1] = inputs.cu_seqlens_q, t, size
        staging[5, :n], staging[5, n:rows] = inputs.logits_indices, int(inputs.logits_indices[0]) if n else 0
        width = inputs.block_tables.shape[1]
        self.staging_tables[:b, :width] = inputs.block_tables
        self.static_ints.copy_(staging, non_blocking=True)
        self.static_tables[:b].copy_(self.staging_tables[:b], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Replay the bucket that holds the step; returns the step's ``[N, V]`` logits, a view valid until the
        next replay."""
        size = self.bucket(inputs)
        if size is None:
            raise ValueError(f"no mixed-step graph holds {inputs.num_tokens} tokens of {inputs.num_seqs} sequences")
        self._fill(size, inputs)
        self.graphs[size].replay()
        return self.outputs[size][: inputs.logits_indices.shape[0]]


def _empty_step() -> StepInputs:
    empty = torch.zeros(0, dtype=torch.long)
    return StepInputs(
        input_ids=empty,
        positions=empty,
        slot_mapping=empty,
        block_tables=torch.zeros(0, 1, dtype=torch.int32),
        cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
        context_lens=empty,
        logits_indices=empty,
    )
