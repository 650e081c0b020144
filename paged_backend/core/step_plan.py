"""The step the scheduler is putting together: which sequences run how many tokens, their proposed tokens, and
the block moves that takes (``StepPlan``). Only the scheduler makes and reads one."""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_backend.core.scheduler_output import BlockMoves, KVImport
from paged_backend.core.sequence import Sequence


@dataclass
class StepPlan:
    """The step being scheduled: who runs how many tokens, and the block moves that takes."""

    budget: int
    scheduled: dict[Sequence, int] = field(default_factory=dict)
    copies: dict[Sequence, BlockMoves] = field(default_factory=dict)
    preempted: set[Sequence] = field(default_factory=set)
    swap_out: BlockMoves = field(default_factory=list)
    swap_in: BlockMoves = field(default_factory=list)
    swapped: list[Sequence] = field(default_factory=list)  # whose blocks swap_out and swap_in move
    kv_imports: list[KVImport] = field(default_factory=list)  # admitted with their prompt's first KV (prompt_kv)
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)  # proposed tokens (counted in ``scheduled``)

    def add(self, seq: Sequence, num_new_tokens: int, copies: BlockMoves, drafts: list[int] | None = None) -> None:
        self.copies[seq] = copies
        self.scheduled[seq] = num_new_tokens
        self.budget -= num_new_tokens
        if drafts:
            self.drafts[seq] = drafts

    def drop(self, seq: Sequence) -> BlockMoves:
        """Unschedule a sequence (it is being preempted); returns the copies planned for it."""
        self.budget += self.scheduled.pop(seq, 0)
        self.drafts.pop(seq, None)
        return self.copies.pop(seq, [])
