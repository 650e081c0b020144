"""OpenAI's ``logprobs`` objects from a completion's per-token ``Logprob`` dicts, for whole responses and for
a stream's new tokens.

Each per-token dict holds the sampled token (with its rank) and the ``k`` most likely tokens (ranks 1..k); the
sampled one appears once, with its rank, whether or not it is among them. Every value sent is a finite float:
a token the sampler filtered out (top-k, top-p, min-p) has logprob -inf and a broken distribution gives NaN,
neither of which JSON can carry, so both become -9999.0 (vLLM's floor, which clients already expect)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from paged_backend.logprobs import Logprob, PromptLogprob
from paged_backend.outputs import CompletionOutput

LOGPROB_FLOOR = -9999.0
Decode = Callable[[list[int]], str]  # token ids -> text


def finite(logprob: float) -> float:
    """``logprob`` as JSON can carry it: NaN and anything below -9999 (-inf included) become -9999.0, +inf 0.0."""
    if math.isnan(logprob) or logprob < LOGPROB_FLOOR:
        return LOGPROB_FLOOR
    return min(logprob, 0.0) if math.isinf(logprob) else logprob


def _text(token_id: int, entry: Logprob | None, decode: Decode) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return decode([token_id])


def _by_rank(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    """The dict's tokens, most likely first (rank 1 first; a missing rank after every ranked one)."""
    return sorted(
        entry.items(), key=lambda item: (item[1].rank if item[1].rank is not None else math.inf, -item[1].logprob)
    )


def completion_logprobs(
    c: CompletionOutput, decode: Decode, start: int = 0, offset: int = 0, as_ids: bool = False
) -> dict[str, Any]:
    """``/v1/completions``' logprobs of tokens ``start:`` (a stream's new ones); ``offset``: where their text
    begins in the choice's text. ``top_logprobs`` maps text to logprob for the ``logprobs`` most likely tokens
    and the sampled one (up to ``logprobs`` + 1 entries, as OpenAI documents); ``as_ids``: tokens named
    ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``), so that tokens that decode alike stay apart."""
    return _legacy_logprobs(c.token_ids[start:], (c.logprobs or [])[start:], decode, offset, as_ids)


def text_length(c: CompletionOutput, decode: Decode, start: int = 0) -> int:
    """How far tokens ``start:`` move ``text_offset``: the length of their texts, as the offsets count them."""
    entries = (c.logprobs or [])[start:]
    return sum(len(_text(t, entry.get(t), decode)) for t, entry in zip(c.token_ids[start:], entries))


def echoed_prompt_logprobs(
    prompt_token_ids: list[int], entries: Sequence[PromptLogprob], decode: Decode, as_ids: bool = False
) -> dict[str, Any]:
    """The echoed prompt's part of a completion's logprobs (OpenAI's legacy format): its first token has no
    logprob (``null``), each later one the model's given the tokens before it."""
    return _legacy_logprobs(prompt_token_ids, entries, decode, 0, as_ids)


def _legacy_logprobs(
    token_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None], decode: Decode, offset: int, as_ids: bool
) -> dict[str, Any]:
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []

    def name(token_id: int, lp: Logprob | None) -> str:
        # keyed by text, as OpenAI's format is; a token without text is keyed by its id, not merged with others
        return f"token_id:{token_id}" if as_ids else _text(token_id, lp, decode) or str(token_id)

    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id) if entry is not None else None
        piece = _text(token_id, chosen, decode)
        tokens.append(name(token_id, chosen) if as_ids else piece)
        token_logprobs.append(finite(chosen.logprob) if chosen is not None else None)
        top.append(None if entry is None else {name(t, lp): finite(lp.logprob) for t, lp in _by_rank(entry)})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def vllm_prompt_logprobs(entries: Sequence[PromptLogprob]) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` of a choice: per prompt token, ``null`` or {token id: logprob, rank, text}."""
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in entries
    ]


def chat_logprobs(c: CompletionOutput, decode: Decode, top_logprobs: int, start: int = 0) -> dict[str, Any]:
    """``/v1/chat/completions``' logprobs of tokens ``start:``: each token with exactly the ``top_logprobs``
    most likely tokens by rank (the sampled one among them only where its rank earns it a place)."""
    content = []
    for token_id, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        chosen = entry.get(token_id)
        piece = _text(token_id, chosen, decode)
        ranked = []
        for t, lp in _by_rank(entry)[:top_logprobs]:
            text = _text(t, lp, decode)
            ranked.append({"token": text, "logprob": finite(lp.logprob), "bytes": list(text.encode())})
        content.append(
            {
                "token": piece,
                "logprob": finite(chosen.logprob) if chosen is not None else LOGPROB_FLOOR,
                "bytes": list(piece.encode()),
                "top_logprobs": ranked,
            }
        )
    return {"content": content}
