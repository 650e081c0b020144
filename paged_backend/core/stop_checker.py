"""Taking a sequence's sampled tokens: each is appended in order until the sequence finishes — on a stop token
once it has ``min_tokens`` tokens, when its grammar is complete, at ``max_tokens`` or at ``max_model_len`` (vLLM's
``StopChecker``). The scheduler applies the finish: it frees the blocks."""

from __future__ import annotations

from paged_backend.core.sequence import Sequence, SequenceStatus

Finish = tuple[SequenceStatus, int | None]  # the status a sequence ends with, and its stop reason (a stop token)


def append_tokens(seq: Sequence, tokens: list[int], in_round: bool, max_model_len: int) -> tuple[int, Finish | None]:
    """How many of ``tokens`` the sequence took (the rest of a multi-step round was computed for nothing), and
    how it finishes, if it does. This runs for every sampled token: the checks are set up once a sequence."""
    if seq.status.finished:
        return 0, None
    request, params = seq.request, seq.params
    if params.max_tokens == 0:  # scored only (prompt logprobs): its prompt is in, it ends without a token
        return 0, (SequenceStatus.FINISHED_LENGTH, None)
    stop_ids, eos_ids = request.own_stop_token_ids, request.eos_token_ids
    stops_from = seq.num_prompt_tokens + params.min_tokens  # the length from which a stop token stops
    max_len = max_model_len
    if params.max_tokens is not None:
        max_len = min(max_len, seq.num_prompt_tokens + params.max_tokens)
    token_ids = seq.token_ids
    grammar = seq.grammar
    for taken, token in enumerate(tokens, 1):
        if grammar is not None and not grammar.accept_token(token):
            # Only a finished grammar whose stop token min_tokens held back leaves nothing to sample: the output
            # is complete without this token, and this sample alone ends.
            return taken - 1, (SequenceStatus.FINISHED_STOPPED, None)
        if in_round:
            seq.num_computed_tokens += 1  # the forward that sampled this token cached its input
        token_ids.append(token)
        length = len(token_ids)
        stopped = length >= stops_from and (token in stop_ids or token in eos_ids)
        if stopped or (grammar is not None and grammar.is_terminated()):  # a grammar ends on its stop token
            return taken, (SequenceStatus.FINISHED_STOPPED, token if token in stop_ids else None)
        if length >= max_len:
            return taken, (SequenceStatus.FINISHED_LENGTH, None)
    return len(tokens), None
