"""Proposals from a draft model (vLLM's ``draft_model`` method, HF's ``assistant_model``): a smaller model that
shares the target's tokenizer guesses the next k tokens greedily.

Each sequence keeps the draft's own KV (an HF cache) across steps: a step feeds it only the tokens it has not
seen — the proposals the target took and its own next token — after cutting back what the target refused. The
draft runs on the engine's device, on the scheduler's thread, a sequence at a time: its k small forwards per
step are the cost of its proposals, which pays when it is far smaller than the target.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


class DraftModelProposer:
    def __init__(self, model: Any, num_speculative_tokens: int) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.k = num_speculative_tokens
        # transformers renamed forward's ``past_key_values`` to ``cache`` (the old name warns from 5.24 on)
        parameters = inspect.signature(model.forward).parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self.states: dict[int, tuple[Any, list[int]]] = {}  # seq id -> (its cache, the tokens the cache holds)

    @torch.inference_mode()
    def propose(self, token_ids: list[int], max_tokens: int | None = None, seq_id: int = 0) -> list[int]:
        """Up to ``min(k, max_tokens)`` tokens the draft model would take next, greedily."""
        from transformers import DynamicCache

        k = self.k if max_tokens is None else min(self.k, max_tokens)
        if k <= 0:
            return []
        cache, seen = self.states.get(seq_id, (None, []))
        common = 0  # the tokens the cache holds that are still the sequence's
        for held, token in zip(seen, token_ids):
            if held != token:
                break
            common += 1
        common = min(common, len(token_ids) - 1)  # the last token is fed again: its logits give the first guess
        if cache is None or common == 0:
            cache, common = DynamicCache(), 0
        elif common < cache.get_seq_length():
            cache.crop(common - cache.get_seq_length())  # negative: drop that many (transformers >= 5.24 wants it)
        proposals: list[int] = []
        feed = token_ids[common:]
        for _ in range(k):
            ids = torch.tensor([feed], device=self.device)
            logits = self.model(input_ids=ids, use_cache=True, **{self.cache_argument: cache}).logits
            proposals.append(int(logits[0, -1].argmax()))
            feed = proposals[-1:]
        self.states[seq_id] = (cache, token_ids + proposals[:-1])  # the last guess is not in the cache
        return proposals

    def forget(self, seq_id: int) -> None:
        """The sequence ended: its cache goes."""
        self.states.pop(seq_id, None)
