"""Incremental detokenization and stop-string handling.

Text is produced piece by piece (vLLM's prefix/read offsets): each new token is decoded together with a few
previous ones so spaces and merges come out right, and a piece that ends in an incomplete UTF-8 character is
held back until it resolves; at the sequence's end whatever is still held back is added, so the final text is
exactly ``decode`` of its tokens. The final text is exactly the concatenation of the pieces. While a request runs,
any tail of the text that could still become a stop string is held back too, so streamed text never has to be
taken back when a stop string is cut.
"""

from __future__ import annotations

from typing import Protocol, cast

from paged_backend.core.sequence import Sequence


class Tokenizer(Protocol):
    """What detokenizing needs of a Hugging Face tokenizer: ``decode``, which transformers types for a batch of
    sequences too (a list of strings)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...


def decode_text(tokenizer: Tokenizer, token_ids: list[int], skip_special_tokens: bool = False) -> str:
    """The text of one sequence of ids (``skip_special_tokens`` defaults as in transformers).

    A transformers tokenizer's ``decode`` first converts its argument to Python lists, then calls ``_decode``;
    the ids here are a list of ints already, and on transformers 5.17 the conversion walks every id in Python,
    costing more than the decoding (twice per generated token). So ``_decode`` is called where it exists."""
    direct = getattr(tokenizer, "_decode", None)
    if direct is not None:
        return cast(str, direct(token_ids, skip_special_tokens=skip_special_tokens))
    return cast(str, tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))  # one sequence: one str


# Decode this many earlier tokens with each new one: enough context for spaces and multi-token characters.
INITIAL_CONTEXT_TOKENS = 5


def init_offsets(seq: Sequence) -> None:
    """Start decoding right after the prompt, using its last tokens as context (none when the prompt was
    embeddings: its ids are placeholders)."""
    seq.read_offset = seq.num_prompt_tokens
    context = INITIAL_CONTEXT_TOKENS if seq.request.prompt_embeds is None else 0
    seq.prefix_offset = max(seq.num_prompt_tokens - context, 0)


def detokenize_incrementally(tokenizer: Tokenizer, seq: Sequence, num_tokens: int) -> str:
    """Return the text that tokens up to ``num_tokens`` add (possibly empty) and advance the sequence's offsets.
    (A round's tokens are appended together and decoded one by one.)"""
    prefix_text, new_text = _decode_window(tokenizer, seq, num_tokens)
    if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
        return ""  # nothing new yet, or an incomplete UTF-8 character: wait for the next token
    seq.prefix_offset = seq.read_offset
    seq.read_offset = num_tokens
    return new_text[len(prefix_text) :]


def _decode_window(tokenizer: Tokenizer, seq: Sequence, num_tokens: int) -> tuple[str, str]:
    """The text of the context tokens before the unread ones, and of the context plus tokens up to ``num_tokens``."""
    skip = seq.params.skip_special_tokens
    ids = seq.token_ids
    prefix_text = decode_text(tokenizer, ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
    return prefix_text, decode_text(tokenizer, ids[seq.prefix_offset : num_tokens], skip_special_tokens=skip)


def flush_text(tokenizer: Tokenizer, seq: Sequence, num_tokens: int) -> str:
    """At a sequence's end: the text its held-back tokens up to ``num_tokens`` add, an incomplete UTF-8 character
    included (as "\ufffd", as ``decode`` of the whole output gives it), so the final text is exactly that decode."""
    prefix_text, new_text = _decode_window(tokenizer, seq, num_tokens)
    seq.prefix_offset, seq.read_offset = seq.read_offset, num_tokens
    return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


def visible_text(seq: Sequence) -> str:
    """Text that is safe to show now: all of it once finished, else without a possible stop-string start."""
    if seq.status.finished or not seq.stop_held:
        return seq.output_text
    return seq.output_text[: len(seq.output_text) - seq.stop_held]
