"""CUDA graphs around a lookup round's verifying step (worker/lookup_round.py): what comes before its forward (the
lookup and the inputs it makes) and what comes after (the greedy tokens, what is taken, the token ids written on),
for the verifying steps' graph buckets that hold a round's rows.

The two sides are dozens of small operations. Launched one by one from Python they take the host longer than the
forward takes the GPU, so a round's steps, queued back to back, still leave the device waiting between them.
Captured, a step is three launches: before, the verifying forward's own graph, after. The rows' token ids and
counts live in this object's static buffers for as long as their rounds go on; rows past the batch in a bucket are
padding (``valid`` false): no cache slot written, no context read, their counts kept.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from paged_backend.core.lookup_round import LOOKUP_ROUND_MAX_ROWS
from paged_backend.worker.cuda_graphs import CUDAGraphRunner, capture_buckets
from paged_backend.worker.lookup_step import LookupInputs, take_tokens, token_rows
from paged_backend.worker.step_inputs import queued_copy

Greedy = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class LookupGraphs:
    def __init__(self, verify: CUDAGraphRunner, ngram_sizes: tuple[int, int], block_size: int, greedy: Greedy) -> None:
        self.verify, self.ngram_sizes, self.block_size, self.greedy = verify, ngram_sizes, block_size, greedy
        self.capacity = verify.static_tables.shape[1] * block_size  # the tokens a row's block table can hold
        self.k = verify.q_len - 1
        # the buckets up to the first that holds a round's rows (core/lookup_round.py plans no more)
        self.largest = next(size for size in verify.sizes if size >= min(LOOKUP_ROUND_MAX_ROWS, verify.max_size))
        rows, device = self.largest, verify.device
        self.num_rows = 0  # the rows of the round last started
        self.history = torch.zeros(rows, self.capacity, dtype=torch.long, device=device)  # [R, C] token ids
        self.lens = torch.ones(rows, dtype=torch.long, device=device)  # [R] each row's count
        self.max_lens = torch.ones(rows, dtype=torch.long, device=device)  # [R] no proposal past it
        self.valid = torch.zeros(rows, dtype=torch.bool, device=device)  # [R] a row of the batch, not padding
        self.found: dict[int, torch.Tensor] = {}  # bucket -> its lookup's proposals and their count [size, k + 1]
        self.records: dict[int, torch.Tensor] = {}  # bucket -> [size, 2 (k + 1) + 2] (PendingLookupRound's)
        self.before: dict[int, torch.cuda.CUDAGraph] = {}
        self.after: dict[int, torch.cuda.CUDAGraph] = {}

    def holds(self, num_seqs: int, k: int, ngram_sizes: tuple[int, int], capacity: int) -> bool:
        """Whether a round of ``num_seqs`` rows with these settings replays these graphs (a lookup finds the same
        in wider buffers: columns past a row's count are never matched)."""
        shape = (k, ngram_sizes) == (self.k, self.ngram_sizes) and capacity <= self.capacity
        return shape and any(size >= num_seqs for size in self.after)

    def capture(self) -> None:
        """Both sides for the verifying graphs' buckets up to ``largest`` (captured first: ``after`` reads their
        output)."""
        sizes = [size for size in self.verify.graphs if size <= self.largest]
        if self.largest not in sizes:
            raise RuntimeError("the verifying steps' graphs were not captured")
        self.before, self.found = capture_buckets(sizes, self._before, self.verify.device)
        self.after, self.records = capture_buckets(sizes, self._after, self.verify.device)
        self.history.zero_()  # the captures' warm-up runs wrote on the (padding) rows
        self.lens.fill_(1)

    def _before(self, size: int) -> torch.Tensor:
        """The lookup and the forward's inputs, written into the verifying graph's static buffers; the lookup's
        proposals and their count ``[size, k + 1]`` for ``_after``."""
        verify, valid = self.verify, self.valid[:size, None]
        lens = self.lens[:size]
        inputs = LookupInputs(self.history[:size], lens, self.max_lens[:size], verify.static_tables[:size],
                              self.ngram_sizes, self.k, self.block_size)  # fmt: skip
        ints = [torch.where(valid, inputs.ids, 0), torch.where(valid, inputs.positions, 0)]
        ints.append(torch.where(valid, inputs.slots, -1))
        verify.static_ints[:3, : size * (self.k + 1)].copy_(torch.stack(ints).view(3, -1))
        verify.static_ints[3, :size].copy_(torch.where(valid[:, 0], lens + self.k, 0))
        return torch.cat([inputs.proposals, inputs.proposed[:, None]], dim=1)

    def _after(self, size: int) -> torch.Tensor:
        """The greedy tokens taken while they match the proposals, then the model's own, written on; the step's
        record."""
        found, k = self.found[size], self.k
        tokens, logprobs = (t.view(size, k + 1) for t in self.greedy(self.verify.outputs[size]))
        history, lens, valid = self.history[:size], self.lens[:size], self.valid[:size]
        return take_tokens(found[:, :k], found[:, k], tokens, logprobs, history, lens, valid)

    def start(self, rows: list[list[int]] | None, max_lens: list[int], tables: torch.Tensor) -> int:
        """A round over ``len(max_lens)`` rows: their token ids (None: the rows the last round left, continued)
        and block tables ``[B, W]`` (int32, on the device) put in place; the bucket it replays."""
        num_seqs, verify = len(max_lens), self.verify
        size = next(s for s in verify.sizes if s >= num_seqs)  # captured: see holds()
        device = self.history.device
        if rows is None and num_seqs != self.num_rows:
            raise RuntimeError("a lookup round continues the round before, but that round had other rows")
        self.num_rows = num_seqs
        if rows is not None:
            ids = token_rows(rows, size)
            self.history[:size, : ids.shape[1]].copy_(queued_copy(ids, device))
            counts = torch.tensor([len(tokens) for tokens in rows] + [1] * (size - num_seqs))
            self.lens[:size].copy_(queued_copy(counts, device))
            self.valid[:size].copy_(queued_copy(torch.arange(size) < num_seqs, device))
        self.max_lens[:size].copy_(queued_copy(torch.tensor(max_lens + [1] * (size - num_seqs)), device))
        verify.static_tables[:num_seqs, : tables.shape[1]].copy_(tables)
        verify.static_tables[:num_seqs, tables.shape[1] :] = 0  # no block of an earlier step's rows
        verify.static_tables[num_seqs:size] = 0
        return size

    def step(self, size: int, num_seqs: int) -> torch.Tensor:
        """One verifying step of the round in bucket ``size``: its record ``[B, 2 (k + 1) + 2]``, a copy."""
        self.before[size].replay()
        self.verify.graphs[size].replay()
        self.after[size].replay()
        return self.records[size][:num_seqs].clone()
