"""A grammar that starts once the model's thinking ends (vLLM's structured outputs with a reasoning parser): the
thinking is free text, the answer after ``</think>`` follows the requested format. Until the end marker's tokens
have been generated, every token is allowed and none advances the grammar. A prompt that already holds the
marker (a chat template that closes the thinking, as Qwen3's does with ``enable_thinking: false``) starts the
grammar at once, as vLLM does."""

from __future__ import annotations

from typing import Any

from paged_backend.core.sequence import GrammarState

END_OF_THINKING = "</think>"


def contains(tokens: list[int], marker: tuple[int, ...]) -> bool:
    """Whether ``marker`` occurs in ``tokens`` as a run."""
    n = len(marker)
    return any(tuple(tokens[i : i + n]) == marker for i in range(len(tokens) - n + 1))


class ReasoningGate:
    """``matcher``, held back until ``end_ids`` (the end marker's tokens) have been generated."""

    def __init__(self, matcher: GrammarState, end_ids: tuple[int, ...], ended: bool) -> None:
        if not end_ids:
            raise ValueError("the end-of-thinking marker must be at least one token")
        self.matcher, self.end_ids, self.ended = matcher, end_ids, ended
        self._tail: tuple[int, ...] = ()

    def accept_token(self, token_id: int) -> bool:
        if self.ended:
            return self.matcher.accept_token(token_id)
        self._tail = (*self._tail, token_id)[-len(self.end_ids) :]
        self.ended = self._tail == self.end_ids
        return True

    def fork(self) -> ReasoningGate:
        gate = ReasoningGate(self.matcher.fork(), self.end_ids, self.ended)
        gate._tail = self._tail
        return gate

    def is_terminated(self) -> bool:
        return self.ended and self.matcher.is_terminated()

    def fill_next_token_bitmask(self, bitmask: Any, index: int) -> Any:
        """While thinking, the row keeps every bit set (``fill_grammar_bitmask`` starts it so)."""
        if self.ended:
            return self.matcher.fill_next_token_bitmask(bitmask, index)
        return None
