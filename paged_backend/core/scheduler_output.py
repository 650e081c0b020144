"""The messages of one step: ``SchedulerOutput`` (scheduler → executor), ``ModelRunnerOutput`` (executor →
scheduler) and ``SequenceUpdate`` (scheduler → output processor), in vLLM v1's shape.

A ``SchedulerOutput`` has two parts. ``batch`` is plain data (ints and lists): everything a worker needs to run
the step's forward — token ids to feed, positions, block tables, cache moves, steps in the round, adapters — and
under tensor parallelism it is the one message each step sends to the other ranks. The rest are the sequences
themselves, which only rank 0's sampler reads (sampling parameters, seeded generators, token history).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paged_backend.core.sequence import GrammarState, Request, Sequence
from paged_backend.logprobs import LogprobsArrays
from paged_backend.lora.request import LoRARequest

if TYPE_CHECKING:
    import torch

BlockMoves = list[tuple[int, int]]  # (source block, destination block)
KVImport = tuple[list[tuple["torch.Tensor", "torch.Tensor"]], list[int]]  # (per layer keys, values; block table)
TopLogprobs = list[tuple[int, float, int]]  # (token id, logprob, rank): the sampled token first, then the top k


@dataclass(frozen=True)
class LookupRound:
    """A round of verifying steps whose proposals the device looks up (prompt lookup), the tokens each step takes
    fed to the next on the device (core/lookup_round.py, worker/lookup_round.py)."""

    num_steps: int
    num_speculative_tokens: int  # k: every row runs k + 1 tokens a step
    ngram_sizes: tuple[int, int]  # prompt lookup's (min, max)
    max_lens: list[int]  # [B] each row's length limit (``max_tokens``, ``max_model_len``): no proposal past it
    capacity: int  # token ids a row can hold on the device (``max_model_len``)
    # [B] each row's token ids; None: the rows (the same, in the same order) continue the round queued before
    history: list[list[int]] | None


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work for every rank, in batch order (row ``i`` is the ``i``-th scheduled sequence)."""

    input_token_ids: list[int]  # [T] the new tokens of every row, concatenated
    num_computed_tokens: list[int]  # [B] tokens already in the cache: the first new token's position
    num_scheduled_tokens: list[int]  # [B] new tokens this step
    block_tables: list[list[int]]  # [B][blocks]
    sampling_rows: list[int]  # rows whose new tokens reach their last known token: they sample
    # A multi-step round: row i decodes num_steps[i] tokens greedily, each fed to the next forward on the device.
    num_steps: list[int] | None = None
    blocks_to_swap_out: BlockMoves = field(default_factory=list)  # (device, CPU), made first
    blocks_to_swap_in: BlockMoves = field(default_factory=list)  # (CPU, device), made next
    blocks_to_copy: BlockMoves = field(default_factory=list)  # copy-on-write (src, dst), made before the forward
    lora_requests: list[LoRARequest | None] | None = None  # each row's adapter, when LoRA is enabled
    # Rows whose prompt logprobs are asked: (row, how many of its new tokens, from the first, have a prompt token
    # next). Their logits come first, in this order, before the sampling rows'.
    prompt_logprob_rows: list[tuple[int, int]] = field(default_factory=list)
    # Async scheduling: a round queued behind the previous round, before its tokens were read. Row i's first
    # input is the last token row prev_rows[i] of that round sampled (on the device; input_token_ids hold zeros).
    prev_rows: list[int] | None = None
    # Speculative decoding: each row's proposed tokens, the last of its new tokens (a row with some samples,
    # and its logits come one per new token from its last sampled one on). None when no row has any.
    draft_token_ids: list[list[int]] | None = None
    # Async scheduling: a verifying step queued behind the previous one before its tokens were read (spec_chain.py).
    # Row i's first input is the greedy token of that step's logits row first_from[i] (on the device; its place in
    # input_token_ids holds a zero).
    first_from: list[int] | None = None
    lookup_round: LookupRound | None = None  # a round of verifying steps planned on the device (then num_steps None)

    @property
    def num_seqs(self) -> int:
        return len(self.num_scheduled_tokens)


@dataclass
class SchedulerOutput:
    batch: ScheduledBatch
    seqs: list[Sequence] = field(default_factory=list)  # [B] the scheduled sequences
    # The sequences that sample: those of ``batch.sampling_rows``, then the samples that fork from them this step
    # (a request's other samples take their first token from their parent's logits row).
    sampling_seqs: list[Sequence] = field(default_factory=list)
    fork_parents: list[int] = field(default_factory=list)  # for each forked sample: its parent's sampling index
    # Sequences swapped out or in this step, whether they run or not: if the step fails, their KV is unknown.
    swapped_seqs: list[Sequence] = field(default_factory=list)
    # (``Request.prompt_kv``, block table) of sequences admitted with their prompt's first tokens' KV: the worker
    # writes it into those blocks before the forward (rank 0 only: prompt_kv needs tensor_parallel_size=1)
    kv_imports: list[KVImport] = field(default_factory=list)

    def touched_requests(self) -> list[Request]:
        """The requests whose state this step changes: the ones a failed step takes down."""
        seqs = [*self.seqs, *self.sampling_seqs, *self.swapped_seqs]
        return list({id(seq.request): seq.request for seq in seqs}.values())

    @property
    def is_empty(self) -> bool:
        return self.batch.num_seqs == 0

    def to_wire(self) -> SchedulerOutput:
        """What the other tensor-parallel ranks receive: the batch without Python objects."""
        return SchedulerOutput(self.batch)


@dataclass
class ModelRunnerOutput:
    """What sampling produced, a row per ``SchedulerOutput.sampling_seqs`` entry (empty on ranks other than 0)."""

    sampled_token_ids: list[list[int]] = field(default_factory=list)  # one token, or a round's tokens in order
    logprobs: list[list[float]] = field(default_factory=list)  # of each sampled token
    # when the sample asked for logprobs: one entry per sampled token (a verified row takes several)
    top_logprobs: list[list[TopLogprobs] | None] = field(default_factory=list)
    logits: list[torch.Tensor | None] = field(default_factory=list)  # raw rows, for requests that keep them
    # batch row -> the prompt logprobs of its new tokens' next tokens (see ScheduledBatch.prompt_logprob_rows)
    prompt_logprobs: dict[int, LogprobsArrays] = field(default_factory=dict)
    # a round's grammars, already advanced by its tokens (the sequence takes them in place of its own)
    grammars: list[GrammarState | None] = field(default_factory=list)
    # speculative decoding with a draft model: its guesses of each sample's next tokens, after these ([]: none)
    draft_token_ids: list[list[int]] = field(default_factory=list)
    # a lookup round: for each of its steps, the proposals the lookup made and how many of them were taken
    lookup_counts: list[list[tuple[int, int]]] = field(default_factory=list)


@dataclass
class SequenceUpdate:
    """The tokens one sequence took this step (after stop checks), for the output processor (vLLM v1's
    ``EngineCoreOutput``, per sample)."""

    seq: Sequence
    new_token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[TopLogprobs] | None = None  # one per new token, when the sample asked for logprobs
    logits: torch.Tensor | None = None
