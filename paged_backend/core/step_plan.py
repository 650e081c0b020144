"""The step the scheduler is putting together: which sequences run how many tokens, their proposed tokens, and
the block moves that takes (``StepPlan``), and the step it makes for the worker (``StepPlan.output``). Only the
scheduler makes and reads one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from paged_backend.core.scheduler_output import BlockMoves, KVImport, ScheduledBatch, SchedulerOutput
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

    def output(
        self,
        num_steps: list[int] | None,
        blocks_to_copy: BlockMoves,
        prompt_logprob_rows: list[tuple[int, int]],
        block_table: Callable[[int], list[int]],
        lora: bool,
    ) -> SchedulerOutput:
        """The planned step as the worker gets it: each row's new tokens (its proposals last), the rows that
        sample, and a request's other samples forked from its first once its prompt is in."""
        seqs, num_new = list(self.scheduled), list(self.scheduled.values())
        tokens: list[int] = []
        sampling_rows: list[int] = []
        for row, (seq, n) in enumerate(zip(seqs, num_new)):
            start, drafts = seq.num_computed_tokens, self.drafts.get(seq, [])
            tokens += seq.token_ids[start : start + n - len(drafts)] + drafts
            if start + n - len(drafts) == len(seq.token_ids):
                sampling_rows.append(row)
        sampling_seqs = [seqs[row] for row in sampling_rows]
        fork_parents: list[int] = []
        for index, seq in enumerate(list(sampling_seqs)):
            if seq.request.unforked and seq is seq.request.seqs[0]:  # the prompt is in: its samples fork now
                sampling_seqs += seq.request.unforked
                fork_parents += [index] * len(seq.request.unforked)
        batch = ScheduledBatch(
            input_token_ids=tokens,
            num_computed_tokens=[seq.num_computed_tokens for seq in seqs],
            num_scheduled_tokens=num_new,
            block_tables=[block_table(seq.seq_id) for seq in seqs],
            sampling_rows=sampling_rows,
            num_steps=num_steps,
            blocks_to_swap_out=self.swap_out,
            blocks_to_swap_in=self.swap_in,
            blocks_to_copy=blocks_to_copy,
            lora_requests=[seq.request.lora_request for seq in seqs] if lora else None,
            prompt_logprob_rows=prompt_logprob_rows,
            draft_token_ids=[self.drafts.get(seq, []) for seq in seqs] if self.drafts else None,
        )
        return SchedulerOutput(batch, seqs, sampling_seqs, fork_parents, self.swapped, self.kv_imports)
