"""Continuous batching: which sequences run this step, and how many of their tokens.

Every step has a token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``). Running
sequences go first, decodes before unfinished (chunked) prefills, then waiting sequences are admitted in FIFO
order while the blocks of their prompt fit (plus a small watermark), reusing the blocks of their longest cached
prefix (prefix caching, see block_manager.py) and skipping those tokens. Admission looks only at what a sequence
needs now, not at ``max_tokens``; when a running sequence cannot get a block, the newest running request is
preempted: swapped to CPU memory when there is swap space for its blocks (it comes back, oldest first, before
new requests are admitted), else by recompute: its blocks are freed and it waits again, at the front, to redo
its prefill.
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
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, CPU), made first
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (CPU, device), made next

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        # At most this many distinct adapters among running sequences, so any step's fit the device slots.
        self.max_loras = config.lora_config.max_loras if config.lora_config.enable_lora else None
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()  # preempted with their KV in CPU memory, oldest first
        self.num_preemptions = 0
        self.num_swapped_out = 0  # preemptions that swapped rather than recomputed
        self.num_chunked_prefill_steps = 0  # scheduled prefill chunks that stop short of the prompt's end
        self.num_prompt_tokens_admitted = 0  # prompt tokens of first admissions ...
        self.num_prompt_tokens_cached = 0  # ... and those of them served from the prefix cache

    def add_seq(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already in place (a forked sample) joins the running batch."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark finished and release the sequence's blocks (running or waiting); blocks its computed tokens
        filled stay in the prefix cache."""
        seq.status = status
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        self.cache_full_blocks([seq])
        self.block_manager.free(seq.seq_id)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}
        copies: dict[Sequence, list[tuple[int, int]]] = {}
        preempted_now: set[Sequence] = set()
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []

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
                victims = [v for v in self.running if v.request is newest]
                for victim in victims:
                    budget += scheduled.pop(victim, 0)
                    self.block_manager.undo_copies(victim.seq_id, copies.pop(victim, []))
                swap_out += self._preempt(victims)
                preempted_now.update(victims)

        # Swapped requests, oldest first, come back before new ones are admitted, when all their blocks fit.
        while self.swapped and budget > 0:
            group = [s for s in self.swapped if s.request is self.swapped[0].request]
            ids = [s.seq_id for s in group]
            watermark = self.block_manager.watermark_blocks if self.running else 0
            needed = self.block_manager.num_blocks_to_swap_in(ids)
            if not self.running and needed > self.block_manager.num_free_blocks:
                self._recompute(group)  # it cannot come back whole even alone: its samples re-prefill instead
                continue
            if (
                preempted_now.intersection(group)
                or not self._lora_fits(group[0])
                or len(self.running) + len(group) > self.max_num_seqs
                or self.block_manager.num_free_blocks - needed < watermark
            ):
                break
            swap_in += self.block_manager.swap_in(ids)
            for seq in group:
                self.swapped.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                num_new = min(seq.num_uncomputed_tokens, budget)
                result = None
                if num_new:
                    result = self.block_manager.allocate_slots(
                        seq.seq_id, seq.num_computed_tokens, seq.num_computed_tokens + num_new
                    )
                if result is not None:  # else it runs from the next step on, like any running sequence
                    copies[seq] = result
                    scheduled[seq] = num_new
                    budget -= num_new

        # Waiting sequences, FIFO, while the blocks of their whole prompt fit (plus a watermark when others
        # run); blocks of a cached prefix are reused and their tokens skipped; only the chunk that fits the
        # token budget is allocated now.
        # Samples that will fork into the batch once their request's first sample has prefilled need room too.
        to_fork = sum(len(s.request.unforked) for s in self.running if s.request.unforked)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            # FIFO, except that a request whose adapter has no slot left waits for one while later requests
            # (base model, or adapters already running) go ahead.
            index = next((i for i, s in enumerate(self.waiting) if self._lora_fits(s)), None)
            if index is None:
                break
            seq = self.waiting[index]
            if seq in preempted_now and self.running:
                break  # let the running sequences free blocks before it tries again
            if self.running and len(self.running) + to_fork + 1 + len(seq.request.unforked) > self.max_num_seqs:
                break
            cached = self.block_manager.find_cached_prefix(seq.token_ids, seq.lora_id)
            needed = self.block_manager.num_blocks_to_admit(len(seq.token_ids), cached)
            watermark = self.block_manager.watermark_blocks if self.running else 0
            if self.block_manager.num_free_blocks - needed < watermark:
                break
            self.block_manager.allocate_cached_prefix(seq.seq_id, cached)
            seq.num_computed_tokens = len(cached) * self.block_manager.block_size
            if seq.num_cached_prompt_tokens is None:  # first admission: count the prompt tokens it reuses
                seq.num_cached_prompt_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
                self.num_prompt_tokens_admitted += seq.num_prompt_tokens
                self.num_prompt_tokens_cached += seq.num_cached_prompt_tokens
            num_new = min(seq.num_uncomputed_tokens, budget)
            result = self.block_manager.allocate_slots(
                seq.seq_id, seq.num_computed_tokens, seq.num_computed_tokens + num_new
            )
            assert result is not None
            copies[seq] = result
            del self.waiting[index]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            to_fork += len(seq.request.unforked)
            scheduled[seq] = num_new
            budget -= num_new

        self.num_chunked_prefill_steps += sum(1 for seq, n in scheduled.items() if n < seq.num_uncomputed_tokens)
        block_copies = [pair for seq in scheduled for pair in copies.get(seq, ())]
        return SchedulerOutput(list(scheduled), list(scheduled.values()), block_copies, swap_out, swap_in)

    def _lora_fits(self, seq: Sequence) -> bool:
        """Whether ``seq`` can run beside the running sequences without exceeding ``max_loras`` adapters."""
        if self.max_loras is None or seq.lora_id == 0:
            return True
        active = {s.lora_id for s in self.running if s.lora_id}
        return seq.lora_id in active or len(active) < self.max_loras

    def _preempt(self, victims: list[Sequence]) -> list[tuple[int, int]]:
        """Preempt a request's running samples. With swap space that holds their blocks, swap them out (returns
        the copies); otherwise by recompute: drop their KV, and they re-prefill prompt + output so far."""
        victims = sorted(victims, key=lambda s: s.arrival)
        for seq in victims:
            self.running.remove(seq)
        self.num_preemptions += len(victims)
        ids = [seq.seq_id for seq in victims]
        # Swapping is for making room for others: a request that preempts itself alone would only come back to
        # the same shortage, so it recomputes (its samples then re-prefill one by one).
        if self.running and self.block_manager.num_cpu_blocks and self.block_manager.can_swap_out(ids):
            self.num_swapped_out += len(victims)
            for seq in victims:
                seq.status = SequenceStatus.SWAPPED
                self.swapped.append(seq)
            return self.block_manager.swap_out(ids)
        self._recompute(victims)
        return []

    def _recompute(self, seqs: list[Sequence]) -> None:
        """Drop the sequences' KV (device or swapped) and queue them, at the front, to prefill again."""
        for seq in reversed(seqs):
            if seq in self.swapped:
                self.swapped.remove(seq)
            self.block_manager.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def on_step_done(self, output: SchedulerOutput) -> None:
        """The batch ran: its tokens are now in the KV cache."""
        for seq, n in zip(output.seqs, output.num_new_tokens):
            seq.num_computed_tokens += n
        self.cache_full_blocks(output.seqs)

    def cache_full_blocks(self, seqs: list[Sequence]) -> None:
        """Offer the blocks that computed tokens have filled to the prefix cache. Most steps fill no block: the
        check for that stays here, inline, since it runs for every sequence of every step."""
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return
        bs, known = bm.block_size, bm.block_hashes
        for seq in seqs:
            hashes = known.get(seq.seq_id)
            if hashes is None or (len(hashes) + 1) * bs <= seq.num_computed_tokens:
                bm.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.lora_id)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens, over first admissions."""
        return self.num_prompt_tokens_cached / max(1, self.num_prompt_tokens_admitted)
