"""Prompt lookup (vLLM's ``ngram`` method, HF's ``prompt_lookup_num_tokens``): the next tokens are guessed to be
those that followed the last earlier occurrence of the sequence's own last few tokens.

Text that copies from its context (an answer quoting a retrieved passage, code rewritten from the prompt, JSON
that repeats its keys) continues as it did before; the guess costs a scan of the token ids, no model. The longest
suffix (``max_n`` tokens, down to ``min_n``) that occurred before wins, and of its occurrences the most recent,
whose continuation is the likeliest to be repeated now.

That continuation runs from the occurrence to the sequence's end, ``p`` tokens when the occurrence lies ``p`` back.
Fewer than ``k`` means the text repeats with a period of ``p`` (a list's rows, a loop a small greedy model fell
into), and the guess goes on as the repetition would: token ``j`` is the continuation's ``j mod p``, an
overlapping copy. The earliest occurrence of a long repetition proposes the same (HF's choice); the latest one
alone would propose ``p`` tokens a step, two in a loop of two.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int) -> None:
        self.min_n, self.max_n, self.k = min_n, max_n, num_speculative_tokens
        # a sequence's ids as an array, grown by the tokens it took since its last lookup: converting thousands
        # of Python ints at every step would be most of the lookup's host time
        self.arrays: dict[int, tuple[np.ndarray, int]] = {}  # seq id -> (its ids' array, how many it holds)
        self.last_match = 0  # how many tokens the last lookup's suffix matched (0: it proposed nothing)

    def propose(self, token_ids: list[int], max_tokens: int | None = None, seq_id: int | None = None) -> list[int]:
        """``min(k, max_tokens)`` tokens that followed the last earlier occurrence of the longest suffix of
        ``token_ids`` between ``min_n`` and ``max_n`` tokens long (repeated as a period where they run out); none
        when no such suffix occurred before.
        With a ``seq_id``, ``token_ids`` are that sequence's, which only grow until ``forget``.

        One pass over the ids finds where the last token occurred before; only those places are compared
        further back (a step's lookup runs on the host between forwards, over thousands of ids)."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        self.last_match = 0
        if k <= 0 or len(token_ids) < self.min_n + 1:
            return []
        return self._search(self._array(token_ids, seq_id), k)

    def propose_ahead(self, token_ids: list[int], ahead: list[int], max_tokens: int, seq_id: int) -> list[int]:
        """``propose`` over ``token_ids + ahead``, where ``ahead`` are tokens not taken yet (a chained verifying
        step's guesses, core/spec_chain.py): the sequence's kept array serves ``token_ids`` and is not grown by
        them."""
        k = min(self.k, max_tokens)
        self.last_match = 0
        if k <= 0 or len(token_ids) + len(ahead) < self.min_n + 1:
            return []
        return self._search(np.concatenate([self._array(token_ids, seq_id), np.asarray(ahead, dtype=np.int64)]), k)

    def _search(self, ids: np.ndarray, k: int) -> list[int]:
        """The lookup over ``ids`` (at least ``min_n + 1`` of them): ``k`` proposals, or none."""
        length = len(ids)
        ends = np.flatnonzero(ids[: length - 1] == ids[length - 1])  # an earlier occurrence ends at each
        matched = np.ones(ends.size, dtype=np.int64)  # how many of the suffix's tokens each end matches
        alive = np.ones(ends.size, dtype=bool)
        for back in range(1, min(self.max_n, length - 1)):
            before = ends - back
            alive &= before >= 0
            alive[alive] = ids[before[alive]] == ids[length - 1 - back]
            matched += alive
        matched = np.minimum(matched, self.max_n)
        if not ends.size or matched.max() < self.min_n:
            return []
        start = int(ends[np.flatnonzero(matched == matched.max())[-1]]) + 1
        self.last_match = int(matched.max())
        return [int(t) for t in ids[start + np.arange(k) % (length - start)]]  # the period's overlapping copy

    def _array(self, token_ids: list[int], seq_id: int | None) -> np.ndarray:
        """``token_ids`` as int64: the sequence's array with its new tokens written on (doubled as it fills)."""
        length = len(token_ids)
        if seq_id is None:
            return np.asarray(token_ids, dtype=np.int64)
        held, known = self.arrays.get(seq_id, (np.empty(0, dtype=np.int64), 0))
        if known > length or (known and held[known - 1] != token_ids[known - 1]):
            known = 0  # not the ids it was given before: start again
        if length > held.size:
            grown = np.empty(max(2 * length, 64), dtype=np.int64)
            grown[:known] = held[:known]
            held = grown
        held[known:length] = token_ids[known:length]
        self.arrays[seq_id] = (held, length)
        return held[:length]

    def forget(self, seq_id: int) -> None:
        self.arrays.pop(seq_id, None)
