"""From sampled tokens to what the user sees: logprobs, incremental text, stop strings, ``RequestOutput``.

The scheduler has already appended each sequence's tokens and applied stop tokens and lengths; text is needed for
stop strings, so they are found here, and the engine tells the scheduler where each such sequence ends.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from paged_backend.core.scheduler_output import SequenceUpdate
from paged_backend.core.sequence import Request, Sequence, SequenceStatus
from paged_backend.engine.detokenizer import (
    Tokenizer,
    decode_text,
    detokenize_incrementally,
    flush_text,
    init_offsets,
    visible_text,
)
from paged_backend.engine.stop_strings import StopStrings
from paged_backend.logprobs import Logprob, LogprobsArrays, PromptLogprob, PromptLogprobs
from paged_backend.outputs import CompletionOutput, RequestOutput


@dataclass(frozen=True)
class StopStringHit:
    """A sequence whose text reached a stop string: it keeps its first ``num_tokens`` token ids."""

    seq: Sequence
    stop: str
    num_tokens: int


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.num_generated_tokens = 0
        # each request's prompt logprobs as reported, built once; gone with the request
        self._built_prompt_logprobs: weakref.WeakKeyDictionary[Request, PromptLogprobs] = weakref.WeakKeyDictionary()
        self._stop_strings: weakref.WeakKeyDictionary[Request, StopStrings] = weakref.WeakKeyDictionary()

    def add_request(self, request: Request) -> None:
        for seq in request.seqs:
            seq.logprobs = [] if request.params.logprobs is not None else None
            seq.logits = [] if request.keep_logits else None
            init_offsets(seq)
        self.requests[request.request_id] = request

    def process_tokens(self, updates: list[SequenceUpdate]) -> list[StopStringHit]:
        """Take each update's tokens in order: logprobs, kept logits, text; stop at a stop string."""
        hits = [self._process(update) for update in updates]
        return [hit for hit in hits if hit is not None]

    def _process(self, update: SequenceUpdate) -> StopStringHit | None:
        seq, params = update.seq, update.seq.params
        if self.tokenizer is None and seq.logprobs is None and seq.logits is None:  # nothing to show but tokens
            for logprob in update.logprobs:
                seq.cumulative_logprob += logprob
            self.num_generated_tokens += len(update.logprobs)
            return None
        first = len(seq.token_ids) - len(update.new_token_ids)  # index of the first new token
        last = len(update.new_token_ids) - 1
        for j, logprob in enumerate(update.logprobs):
            seq.cumulative_logprob += logprob
            self.num_generated_tokens += 1
            if seq.logprobs is not None and update.top_logprobs is not None:
                seq.logprobs.append(
                    {tid: Logprob(lp, rank, self._decode_one(tid)) for tid, lp, rank in update.top_logprobs[j]}
                )
            if seq.logits is not None and update.logits is not None:
                seq.logits.append(update.logits)
            # The scheduler finishes a sequence as "stopped" only on a stop token, always its last new token.
            stop_token = j == last and seq.status is SequenceStatus.FINISHED_STOPPED
            if self.tokenizer is None or (stop_token and not params.include_stop_str_in_output):
                continue
            delta = detokenize_incrementally(self.tokenizer, seq, first + j + 1)
            seq.output_text += delta
            if not params.stop or not delta:
                continue
            stops = self._stops(seq.request)
            seq.stop_states = seq.stop_states or stops.start()
            counts = not stop_token and first + j + 1 - seq.num_prompt_tokens >= params.min_tokens
            hit = stops.feed(seq.stop_states, delta, len(seq.output_text), report=counts)
            seq.stop_held = stops.held_back(seq.stop_states)
            if hit is not None:
                start, stop = hit
                seq.output_text = seq.output_text[: start + len(stop) if params.include_stop_str_in_output else start]
                return StopStringHit(seq, stop, first + j + 1)
        if self.tokenizer is not None and seq.status.finished:  # an incomplete last character shows, as in decode
            # (here "stopped" is by a stop token, the last one, shown only with include_stop_str_in_output)
            stop_token = seq.status is SequenceStatus.FINISHED_STOPPED and not params.include_stop_str_in_output
            end = len(seq.token_ids) - (1 if stop_token else 0)
            seq.output_text += flush_text(self.tokenizer, seq, end)
        return None

    def _stops(self, request: Request) -> StopStrings:
        stops = self._stop_strings.get(request)
        if stops is None:  # built once a request, at its first text: its samples share the failure tables
            stops = self._stop_strings[request] = StopStrings(request.params.stop_strings)
        return stops

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else decode_text(self.tokenizer, [token_id])

    def make_outputs(self, updates: list[SequenceUpdate], finished_only: bool) -> list[RequestOutput]:
        """Cumulative outputs of the requests that advanced (with ``finished_only``, of those that finished)."""
        advanced = {update.seq.request.request_id: update.seq.request for update in updates}
        now = time.monotonic()
        outputs = []
        for request in advanced.values():
            if request.first_token_time is None:
                request.first_token_time = now
            finished = request.finished
            if finished:
                self.requests.pop(request.request_id, None)
            if finished or (request.params.num_samples == request.params.n and not finished_only):
                outputs.append(make_request_output(request, self._prompt_logprobs(request)))
        return outputs

    def _prompt_logprobs(self, request: Request) -> PromptLogprobs | None:
        """vLLM's ``prompt_logprobs`` (``None`` for the first token, then a dict a token: the actual one and the
        top k), once every prompt token has its entry."""
        chunks = request.prompt_logprobs
        if chunks is None or request.needs_prompt_logprobs:
            return None
        built = self._built_prompt_logprobs.get(request)
        if built is None:  # once a request: a streamed request reports them with every step's output
            arrays = LogprobsArrays.concat(chunks) if chunks else None  # a one-token prompt has none
            decode = None if self.tokenizer is None else functools.partial(decode_one, self.tokenizer)
            built = self._built_prompt_logprobs[request] = PromptLogprobs(arrays, decode)
        return built


def decode_one(tokenizer: Tokenizer, token_id: int) -> str:
    """One token's text on its own (a logprob entry's ``decoded_token``)."""
    return decode_text(tokenizer, [token_id])


def make_request_output(request: Request, prompt_logprobs: SequenceOf[PromptLogprob] | None = None) -> RequestOutput:
    params = request.params
    seqs = request.seqs
    if params.num_samples > params.n:  # only reported once finished: keep the n best, best first
        seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
    outputs = [
        CompletionOutput(
            index=i,
            text=visible_text(seq),
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=float(seq.cumulative_logprob),
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            logits=list(seq.logits) if seq.logits is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        for i, seq in enumerate(seqs)
    ]
    metrics = {"arrival_time": request.arrival_time}
    if request.first_token_time is not None:
        metrics["first_token_time"] = request.first_token_time
    proposed = sum(seq.num_draft_tokens for seq in seqs)
    if proposed:  # speculative decoding: rows verified, tokens proposed and taken, the share taken, tokens a row
        drafts, taken = sum(seq.num_verified_steps for seq in seqs), sum(seq.num_accepted_tokens for seq in seqs)
        metrics |= {"spec_num_drafts": drafts, "spec_num_draft_tokens": proposed, "spec_num_accepted_tokens": taken}
        metrics["spec_acceptance_rate"] = taken / proposed
        metrics["spec_mean_accepted_length"] = 1 + taken / drafts
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=list(request.prompt_token_ids) if request.prompt_embeds is None else [],
        outputs=outputs,
        finished=request.finished,
        prompt_logprobs=prompt_logprobs,
        lora_request=request.lora_request,
        metrics=metrics,
    )
