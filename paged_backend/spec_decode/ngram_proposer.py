"""Prompt lookup (vLLM's ``ngram`` method, HF's ``prompt_lookup_num_tokens``): the next tokens are guessed to be
those that followed the last earlier occurrence of the sequence's own last few tokens.

Text that copies from its context (an answer quoting a retrieved passage, code rewritten from the prompt, JSON
that repeats its keys) continues as it did before; the guess costs a scan of the token ids, no model. The longest
suffix (``max_n`` tokens, down to ``min_n``) that occurred before wins, and of its occurrences the most recent,
whose continuation is the likeliest to be repeated now.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int) -> None:
        self.min_n, self.max_n, self.k = min_n, max_n, num_speculative_tokens

    def propose(self, token_ids: list[int], max_tokens: int | None = None, seq_id: int = 0) -> list[int]:
        """Up to ``min(k, max_tokens)`` tokens that followed the last earlier occurrence of the longest suffix
        of ``token_ids`` between ``min_n`` and ``max_n`` tokens long; none when no such suffix occurred before."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        length = len(token_ids)
        if k <= 0 or length < self.min_n + 1:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows starting at 0 .. length - n - 1: every n-gram but the suffix itself
            windows = sliding_window_view(ids[: length - 1], n)  # [length - n, n]
            found = np.flatnonzero((windows == ids[length - n :]).all(axis=1))
            if found.size:
                start = int(found[-1]) + n
                return [int(t) for t in ids[start : start + k]]
        return []
