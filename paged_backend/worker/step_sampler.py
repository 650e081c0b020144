"""A single step's sampling, from its logits (``DeferredOutput`` runs it when the step is read): a row per sampling
sequence, or one per proposal verified (rejection_sampler.py), the rows of prompt logprobs first, forked samples'
first tokens from their parent's row, grammars' masks applied after the raw rows a request keeps."""

from __future__ import annotations

import torch

from paged_backend.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from paged_backend.worker.prompt_logprobs import step_prompt_logprobs
from paged_backend.worker.rejection_sampler import draft_views, sampling_drafts, take_verified
from paged_backend.worker.sampler import Sampler
from paged_backend.worker.structured_output import apply_grammar_bitmask, fill_grammar_bitmask


def sample_step(
    sampler: Sampler, logits: torch.Tensor, *, scheduler_output: SchedulerOutput, pin: bool
) -> ModelRunnerOutput:
    """A single step's sampling, from its logits: a row per sequence, or per proposal (rejection_sampler.py)."""
    batch, seqs = scheduler_output.batch, scheduler_output.sampling_seqs
    # on the host while the forward runs
    drafts = sampling_drafts(batch, len(seqs))
    views, firsts = draft_views(seqs, drafts)
    grammar_mask = fill_grammar_bitmask(views, logits.shape[-1], pin=pin)
    prompt = {}
    if batch.prompt_logprob_rows:
        num_prompt = sum(count for _, count in batch.prompt_logprob_rows)
        if scheduler_output.seqs:  # rank 0: it has the sequences, and so the tokens after each chunk
            prompt = step_prompt_logprobs(logits[:num_prompt], scheduler_output)
        logits = logits[num_prompt:]
    if not seqs:
        return ModelRunnerOutput(prompt_logprobs=prompt)
    if scheduler_output.fork_parents:  # forked samples draw their first token from their parent's row
        logits = torch.cat([logits, logits[[firsts[p] for p in scheduler_output.fork_parents]]])  # [N + F, V]
    kept = [logits[firsts[i]].float().cpu() if seq.request.keep_logits else None for i, seq in enumerate(seqs)]
    if grammar_mask is not None:  # after the raw rows are kept
        apply_grammar_bitmask(logits, grammar_mask)
    results = take_verified(sampler(logits, views), drafts)
    return ModelRunnerOutput(
        [[r.token_id for r in taken] for taken in results],
        [[r.logprob for r in taken] for taken in results],
        [None if taken[0].top_logprobs is None else [r.top_logprobs or [] for r in taken] for taken in results],
        kept if any(row is not None for row in kept) else [],
        prompt,
    )
