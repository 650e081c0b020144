"""Continuous batching: which sequences run this step, how many of their tokens, and what their sampled tokens do.

The scheduler is the only owner of KV decisions: it alone calls the ``BlockManager``. Every step has a token
budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``). Running sequences go first, decodes
before unfinished (chunked) prefills, then swapped-out requests come back, then waiting sequences are admitted in
FIFO order while the blocks of their prompt fit (plus a small watermark), reusing the blocks of their longest
cached prefix (prefix caching, see block_manager.py) and skipping those tokens. Admission looks only at what a
sequence needs now, not at ``max_tokens``; when a running sequence cannot get a block, the newest running request
is preempted: swapped to CPU memory when there is swap space for its blocks (it comes back, oldest first, before
new requests are admitted), else by recompute: its blocks are freed and it waits again, at the front, to redo
its prefill. A request redone after a failed step (``retry_alone``) gets steps of its own until one samples it.

After the step has run, ``update_from_output`` counts the computed tokens, forks a request's other samples
from its first one (their blocks shared, copy-on-write), appends the sampled tokens with the stop-token, grammar
and length checks (stop_checker.py), and frees the blocks of every sequence that finishes. Stop strings need
text: the output processor finds them and calls ``finish_seq`` with the length to keep.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from paged_backend.config import EngineConfig
from paged_backend.core.block_manager import BlockManager
from paged_backend.core.lookup_round import lookup_continuation, lookup_round, observe_lookup_round
from paged_backend.core.multi_step import continuation, plan_round
from paged_backend.core.prompt_logprobs import prompt_logprob_rows, take_prompt_logprobs
from paged_backend.core.scheduler_output import (
    BlockMoves,
    ModelRunnerOutput,
    SchedulerOutput,
    SequenceUpdate,
)
from paged_backend.core.sequence import Request, Sequence, SequenceStatus
from paged_backend.core.spec_chain import stale_rows, verify_continuation
from paged_backend.core.spec_decode import DraftPlanner, Proposer
from paged_backend.core.step_plan import StepPlan
from paged_backend.core.stop_checker import append_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, proposer: Proposer | None = None) -> None:
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        # At most this many distinct adapters among running sequences, so any step's fit the device's LoRA indices.
        self.max_loras = config.lora_config.max_loras if config.lora_config.enable_lora else None
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.num_scheduler_steps = config.scheduler_config.num_scheduler_steps
        self.grammar_rounds = config.parallel_config.tensor_parallel_size == 1  # see multi_step.py
        self.long_prefill_token_threshold = config.scheduler_config.long_prefill_token_threshold
        self.block_manager = block_manager
        spec = config.speculative_config
        self.drafter = None if spec is None else DraftPlanner(spec, config.max_model_len, proposer)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()  # preempted with their KV in CPU memory, oldest first
        self.run_alone: set[Request] = set()  # to run in steps of their own until they sample (retry_alone)
        self.num_preemptions = 0
        self.num_swapped_out = 0  # preemptions that swapped rather than recomputed
        self.num_chunked_prefill_steps = 0  # scheduled prefill chunks that stop short of the prompt's end
        self.num_prompt_tokens_admitted = 0  # prompt tokens of first admissions ...
        self.num_prompt_tokens_cached = 0  # ... and those of them served from the prefix cache

    def add_request(self, request: Request) -> None:
        """Queue a request: one prefill for all its samples; the others fork its blocks when it samples."""
        first = request.seqs[0]
        first.status = SequenceStatus.WAITING
        self.waiting.append(first)
        request.unforked = request.seqs[1:]

    def reset_prefix_cache(self) -> None:
        """Cached prefixes hold KV of the weights they were computed with: after the weights change, none is
        reused."""
        self.block_manager.reset_prefix_cache()

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish_seq(
        self,
        seq: Sequence,
        status: SequenceStatus,
        stop_reason: int | str | None = None,
        num_tokens: int | None = None,
        cache_blocks: bool = True,
    ) -> None:
        """Mark finished and release the sequence's blocks; blocks its computed tokens filled stay in the prefix
        cache. ``num_tokens`` cuts tokens a stop string made void (sampled in the same round after it); a
        sequence that had already finished only takes the new status and reason. ``cache_blocks=False``: its
        step failed, and a block it swapped in may hold no KV (earlier blocks were cached as they filled)."""
        if num_tokens is not None and num_tokens < len(seq.token_ids):
            del seq.token_ids[num_tokens:]
            seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens - 1)
        if stop_reason is not None:
            seq.stop_reason = stop_reason
        was_finished = seq.status.finished
        seq.status = status
        if was_finished:
            return
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        if cache_blocks:
            self.cache_full_blocks([seq])
        self.block_manager.free(seq.seq_id)
        if self.drafter is not None:
            self.drafter.forget(seq)

    def retry_alone(self, request: Request) -> None:
        """A step that ran this request beside others failed, which of them made it fail unknown: redo it from its
        tokens (earlier blocks stay cached), alone, so a step that fails with it next has no other request."""
        self._recompute([seq for seq in request.seqs if seq in self.running or seq in self.swapped])
        self.run_alone.add(request)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        plan = StepPlan(self.max_num_batched_tokens)
        include: Callable[[Sequence], bool] | None = None
        if self.run_alone:
            alone = self._alone_request()
            if alone is not None:  # a step of its own, while the others wait a step
                self._schedule_running(plan, lambda seq: seq.request is alone)
                self._schedule_waiting(plan, lambda seq: seq.request is alone)
            include = lambda seq: seq.request not in self.run_alone  # noqa: E731
        if not plan.scheduled:  # the usual step, without a request that must run alone (it waits for blocks)
            self._schedule_running(plan, include)
            self._schedule_swapped(plan, include)
            self._schedule_waiting(plan, include)
        self.num_chunked_prefill_steps += sum(1 for seq, n in plan.scheduled.items() if n < seq.num_uncomputed_tokens)
        return self._make_output(plan)

    def schedule_continuation(self, in_flight: SchedulerOutput, read: int = 0) -> SchedulerOutput | None:
        """Async scheduling's round after ``in_flight`` (of which ``read`` steps are counted), or None
        (``multi_step.continuation``)."""
        if in_flight.batch.lookup_round is not None:
            return lookup_continuation(self, in_flight)
        if in_flight.batch.num_steps is None:
            return verify_continuation(self, in_flight)
        return continuation(self, in_flight, read)

    def _chunk(self, seq: Sequence, plan: StepPlan) -> int:
        """The sequence's tokens this step: what it has left, within the step's budget and the chunk cap."""
        num_new = min(seq.num_uncomputed_tokens, plan.budget)
        if 0 < self.long_prefill_token_threshold < num_new:
            return self.long_prefill_token_threshold
        return num_new

    def _schedule_running(self, plan: StepPlan, include: Callable[[Sequence], bool] | None) -> None:
        """Running sequences: decodes first, then unfinished prefills; oldest first within each."""
        drafter = self.drafter if self.drafter is not None and self.drafter.active(len(self.running)) else None
        for seq in sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.arrival)):
            if plan.budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or (include is not None and not include(seq)):
                continue  # preempted earlier in this loop, or not in this step
            num_new = self._chunk(seq, plan)
            drafts = drafter.drafts(seq, plan.budget) if drafter is not None and num_new == 1 else []
            if drafts and self._spare_blocks_for(seq, 1 + len(drafts)):  # else it decodes a token like the others
                copies = self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, 1 + len(drafts))
                if copies is not None:
                    plan.add(seq, 1 + len(drafts), copies, drafts)
                    continue
            if num_new == 1 and self.block_manager.has_private_slot(seq.seq_id, seq.num_computed_tokens):
                plan.add(seq, 1, [])  # a decode whose slot is already allocated and not shared
                continue
            while seq.status is SequenceStatus.RUNNING:
                copies = self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
                if copies is not None:
                    plan.add(seq, num_new, copies)
                    break
                # Out of blocks: preempt the newest running request (all its samples), maybe this one.
                newest = max(self.running, key=lambda s: s.arrival).request
                victims = [v for v in self.running if v.request is newest]
                for victim in victims:
                    self.block_manager.undo_copies(victim.seq_id, plan.drop(victim))
                swap_out = self._preempt(victims)
                if swap_out:
                    plan.swap_out += swap_out
                    plan.swapped += victims
                plan.preempted.update(victims)

    def _spare_blocks_for(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq``'s proposals' blocks leave the watermark free: they never push a request out."""
        bm = self.block_manager
        needed = bm.num_new_blocks_needed(seq.seq_id, seq.num_computed_tokens, seq.num_computed_tokens + num_tokens)
        return bm.num_free_blocks - needed >= bm.watermark_blocks

    def _schedule_swapped(self, plan: StepPlan, include: Callable[[Sequence], bool] | None) -> None:
        """Swapped requests, oldest first, come back before new ones are admitted, when all their blocks fit."""
        bm = self.block_manager
        while self.swapped and plan.budget > 0 and (include is None or include(self.swapped[0])):
            group = [s for s in self.swapped if s.request is self.swapped[0].request]
            ids = [s.seq_id for s in group]
            watermark = bm.watermark_blocks if self.running else 0
            needed = bm.num_blocks_to_swap_in(ids)
            if not self.running and needed > bm.num_free_blocks:
                self._recompute(group)  # it cannot come back whole even alone: its samples re-prefill instead
                continue
            if (
                plan.preempted.intersection(group)
                or not self._lora_fits(group[0])
                or len(self.running) + len(group) > self.max_num_seqs
                or bm.num_free_blocks - needed < watermark
            ):
                break
            plan.swap_in += bm.swap_in(ids)
            plan.swapped += group
            for seq in group:
                self.swapped.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                num_new = self._chunk(seq, plan)
                copies = bm.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new) if num_new else None
                if copies is not None:  # else it runs from the next step on, like any running sequence
                    plan.add(seq, num_new, copies)

    def _schedule_waiting(self, plan: StepPlan, include: Callable[[Sequence], bool] | None) -> None:
        """Waiting sequences, FIFO, while the blocks of their whole prompt fit (plus a watermark when others run);
        blocks of a cached prefix are reused and their tokens skipped; only the chunk that fits the token budget
        is allocated now. Samples that will fork once their request's first sample has prefilled need room too."""
        bm = self.block_manager
        to_fork = sum(len(s.request.unforked) for s in self.running if s.request.unforked)
        while self.waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            # FIFO, except that a request whose adapter finds no LoRA index free waits for one while later requests
            # (base model, or adapters already running) go ahead.
            index = next((i for i, s in enumerate(self.waiting) if self._lora_fits(s)), None)
            if index is None:
                break
            seq = self.waiting[index]
            if include is not None and not include(seq):
                break  # FIFO: nothing passes a request that waits to run alone
            if seq in plan.preempted and self.running:
                break  # let the running sequences free blocks before it tries again
            if self.running and len(self.running) + to_fork + 1 + len(seq.request.unforked) > self.max_num_seqs:
                break
            # a cached prefix has no logits: a request still missing prompt logprobs computes its whole prompt
            uncached = seq.request.needs_prompt_logprobs or not seq.request.cacheable
            cached = [] if uncached else bm.find_cached_prefix(seq.token_ids, seq.lora_id)
            needed = bm.num_blocks_to_admit(len(seq.token_ids), cached)
            watermark = bm.watermark_blocks if self.running else 0
            if bm.num_free_blocks - needed < watermark:
                break
            bm.allocate_cached_prefix(seq.seq_id, cached)
            if not seq.request.cacheable:
                bm.stop_caching(seq.seq_id)
            seq.num_computed_tokens = len(cached) * bm.block_size
            if seq.num_cached_prompt_tokens is None:  # first admission: count the prompt tokens it reuses
                seq.num_cached_prompt_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
                self.num_prompt_tokens_admitted += seq.num_prompt_tokens
                self.num_prompt_tokens_cached += seq.num_cached_prompt_tokens
            seq.num_computed_tokens += seq.request.num_imported_tokens  # KV it brings (prompt_kv), not computed
            num_new = self._chunk(seq, plan)
            copies = bm.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
            assert copies is not None  # its blocks were counted above
            if seq.request.prompt_kv is not None:  # the worker writes it into its slots before the forward
                plan.kv_imports.append((seq.request.prompt_kv, bm.get_block_table(seq.seq_id)))
            del self.waiting[index]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            to_fork += len(seq.request.unforked)
            plan.add(seq, num_new, copies)

    def _make_output(self, plan: StepPlan) -> SchedulerOutput:
        seqs, num_new = list(plan.scheduled), list(plan.scheduled.values())
        blocks_to_copy = [pair for seq in seqs for pair in plan.copies[seq]]
        prompt_rows = prompt_logprob_rows(seqs, num_new)
        num_steps = None
        if self.num_scheduler_steps > 1 and not (blocks_to_copy or plan.swap_out or plan.swap_in or prompt_rows):
            # The round's extra slots may copy shared blocks: those copies are made even when it does not run.
            num_steps, blocks_to_copy = plan_round(
                seqs, num_new, self.num_scheduler_steps, self.max_model_len, self.block_manager, self.grammar_rounds
            )
        lora = self.max_loras is not None
        output = plan.output(num_steps, blocks_to_copy, prompt_rows, self.block_manager.get_block_table, lora)
        return (lookup_round(self, output) if plan.drafts else None) or output

    def _alone_request(self) -> Request | None:
        """The request to run alone next (see ``retry_alone``): one already running, else the first waiting."""
        self.run_alone = {request for request in self.run_alone if not request.finished}
        running = next((s.request for s in self.running if s.request in self.run_alone), None)
        head = self.waiting[0].request if self.waiting else None
        return running or (head if head in self.run_alone else None)

    def _lora_fits(self, seq: Sequence) -> bool:
        """Whether ``seq`` can run beside the running sequences without exceeding ``max_loras`` adapters."""
        if self.max_loras is None or seq.lora_id == 0:
            return True
        active = {s.lora_id for s in self.running if s.lora_id}
        return seq.lora_id in active or len(active) < self.max_loras

    def _preempt(self, victims: list[Sequence]) -> BlockMoves:
        """Preempt a request's running samples. With swap space that holds their blocks, swap them out (returns
        the copies); otherwise by recompute: drop their KV, and they re-prefill prompt + output so far."""
        victims = sorted(victims, key=lambda s: s.arrival)
        for seq in victims:
            self.running.remove(seq)
        self.num_preemptions += len(victims)
        ids = [seq.seq_id for seq in victims]
        # Swapping makes room for others: a request preempting only itself would come back to the same shortage.
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
            for queue in (self.running, self.swapped):
                if seq in queue:
                    queue.remove(seq)
            self.block_manager.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ update
    def update_from_output(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[SequenceUpdate]:
        """The step ran: count its tokens as computed, fork samples, append each sampled token until a stop."""
        in_round = output.batch.num_steps is not None or output.batch.lookup_round is not None
        # A queued step (async scheduling) may hold rows that ended before it was read, or that a chained verifying
        # step ran at positions the step before did not reach (spec_chain.py): nothing of theirs counts.
        stale = set(stale_rows(output))
        for row, entries in runner_output.prompt_logprobs.items():  # an aborted request's are never read
            take_prompt_logprobs(output.seqs[row], output.batch.num_computed_tokens[row], entries)
        drafts = output.batch.draft_token_ids
        if not in_round:  # a round, and a row with proposals, count their tokens one by one below, as taken
            for row, (seq, n) in enumerate(zip(output.seqs, output.batch.num_scheduled_tokens)):
                counts = not (drafts and drafts[row]) and not seq.status.finished and row not in stale
                seq.num_computed_tokens += n if counts else 0
            self.cache_full_blocks([seq for seq in output.seqs if not seq.status.finished])
        num_parents = len(output.sampling_seqs) - len(output.fork_parents)
        for child, parent in zip(output.sampling_seqs[num_parents:], output.fork_parents):
            if not output.sampling_seqs[parent].status.finished:
                self._fork(output.sampling_seqs[parent], child)
        updates = []
        if self.run_alone:  # a step that sampled them succeeded: they rejoin the batch
            self.run_alone.difference_update(seq.request for seq in output.sampling_seqs)
        for row, seq in enumerate(output.sampling_seqs):
            if seq.status.finished or row in stale:  # ended (or aborted) while a step queued behind ran, or stale
                continue
            tokens = runner_output.sampled_token_ids[row]
            if in_round and not tokens:  # a round read a step at a time: this row took fewer steps
                continue
            if runner_output.grammars and runner_output.grammars[row] is not None:
                seq.grammar = runner_output.grammars[row]  # the round's, which took these tokens already
            row_drafts = drafts[output.batch.sampling_rows[row]] if drafts and row < num_parents else []
            taken, finish = append_tokens(seq, tokens, in_round or bool(row_drafts), self.max_model_len)
            if self.drafter is not None and runner_output.lookup_counts:
                observe_lookup_round(self.drafter, seq, runner_output.lookup_counts[row], taken)
            elif self.drafter is not None:
                guesses = runner_output.draft_token_ids[row] if runner_output.draft_token_ids else []
                self.drafter.observe(seq, row_drafts, tokens[:taken], finish is None, len(self.running), guesses)
            if finish is not None:
                self.finish_seq(seq, *finish)
            top = runner_output.top_logprobs[row] if runner_output.top_logprobs else None
            top = None if top is None else top[:taken]
            logits = runner_output.logits[row] if runner_output.logits else None
            updates.append(SequenceUpdate(seq, tokens[:taken], runner_output.logprobs[row][:taken], top, logits))
        if in_round or drafts:  # finished sequences offered their blocks to the prefix cache in finish_seq
            self.cache_full_blocks([seq for seq in output.seqs if not seq.status.finished])
        return updates

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """A sample joins the running batch on its first sample's blocks, by reference (copy-on-write)."""
        self.block_manager.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_prompt_tokens = 0  # the prompt was counted once, with the first sample
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        parent.request.unforked = []

    def cache_full_blocks(self, seqs: list[Sequence]) -> None:
        """Offer the blocks that computed tokens have filled to the prefix cache. Most steps fill no block: the
        check for that stays here, inline, since it runs for every sequence of every step."""
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return
        bs, known = bm.block_size, bm.prefix_ids_of
        for seq in seqs:
            ids = known.get(seq.seq_id)
            if ids is None or (len(ids) + 1) * bs <= seq.num_computed_tokens:
                bm.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.lora_id)
