"""Continuous batching: which sequences run this step, and how many of their tokens.

Every step has a token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``). Running
sequences go first, decodes before unfinished (chunked) prefills, then waiting sequences are admitted in FIFO
order while the blocks of their prompt fit (plus a small watermark). Admission looks only at what a sequence
needs now, not at ``max_tokens``; when a running sequence cannot get a block, the newest running request is
preempted by recompute: its blocks are freed and it waits again, at the front, to redo its prefill.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from paged_backend.config import EngineConfig
from paged_backend.core.block_manager import BlockManager
from paged_backend.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step's work: sequences in batch order and the number of new tokens each contributes."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_chunked_prefill_steps = 0  # scheduled prefill chunks that stop short of the prompt's end

    def add_seq(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark finished and release the sequence's blocks (running or waiting)."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq.seq_id)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}
        copies: dict[Sequence, list[tuple[int, int]]] = {}
        preempted_now: set[Sequence] = set()

        # Running sequences: decodes first, then unfinished prefills; oldest first within each.
        for seq in sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.arrival)):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 1 and self.block_manager.has_private_slot(seq.seq_id, seq.num_computed_tokens):
                scheduled[seq] = 1  # a decode whose slot is already allocated and not shared
                budget -= 1
                continue
            while seq.status is SequenceStatus.RUNNING:
                result = self.block_manager.allocate_slots(
                    seq.seq_id, seq.num_computed_tokens, seq.num_computed_tokens + num_new
                )
                if result is not None:
                    copies[seq] = result
                    scheduled[seq] = num_new
                    budget -= num_new
                    break
                # Out of blocks: preempt the newest running request (all its samples), maybe this one.
                newest = max(self.running, key=lambda s: s.arrival).request
                for victim in sorted(self.running, key=lambda s: s.arrival, reverse=True):
                    if victim.request is newest:
                        budget += scheduled.pop(victim, 0)
                        copies.pop(victim, None)
                        self._preempt(victim)
                        preempted_now.add(victim)

        # Waiting sequences, FIFO, while the blocks of their whole prompt fit (plus a watermark when others
        # run); only the chunk that fits the token budget is allocated now.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq in preempted_now and self.running:
                break  # let the running sequences free blocks before it tries again
            needed = self.block_manager.num_new_blocks_needed(seq.seq_id, seq.num_computed_tokens, len(seq.token_ids))
            watermark = self.block_manager.watermark_blocks if self.running else 0
            if self.block_manager.num_free_blocks - needed < watermark:
                break
            num_new = min(seq.num_uncomputed_tokens, budget)
            result = self.block_manager.allocate_slots(
                seq.seq_id, seq.num_computed_tokens, seq.num_computed_tokens + num_new
            )
            assert result is not None
            copies[seq] = result
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[seq] = num_new
            budget -= num_new

        self.num_chunked_prefill_steps += sum(1 for seq, n in scheduled.items() if n < seq.num_uncomputed_tokens)
        block_copies = [pair for seq in scheduled for pair in copies.get(seq, ())]
        return SchedulerOutput(list(scheduled), list(scheduled.values()), block_copies)

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: drop the KV cache; the sequence re-prefills prompt + output so far."""
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def on_step_done(self, output: SchedulerOutput) -> None:
        """The batch ran: its tokens are now in the KV cache."""
        for seq, n in zip(output.seqs, output.num_new_tokens):
            seq.num_computed_tokens += n
