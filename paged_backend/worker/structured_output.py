"""The grammar mask of a step's structured-output rows: filled on the host (each sample's matcher says which
tokens may come next) while the device runs the step's forward, then applied to the logits on the device.

In a multi-step round the host keeps one step behind the device: step k's forward is queued first, then the
host reads step k - 1's tokens (a copy that finished before that forward started), advances a fork of each
row's grammar with them and fills step k's mask while the forward runs. After the round the scheduler takes
the forks in place of the sequences' grammars (``Replayed``: they only check the tokens they already took).
Matchers fill their masks in one call on xgrammar's threads and take their tokens in one call."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from paged_backend.core.sequence import GrammarState
from paged_backend.core.sequence import Sequence as Seq

if TYPE_CHECKING:
    import xgrammar

# [rows, ceil(V / 32)] int32 (bit set: allowed), and the rows it covers (None: all)
Bitmask = tuple[torch.Tensor, list[int] | None]


def fill_grammar_bitmask(seqs: Sequence[Seq], vocab_size: int, pin: bool = False) -> Bitmask | None:
    """The allowed tokens of every row whose sample follows a grammar (None when no row does). Rows without
    one keep every bit set. ``pin``: in page-locked memory, so that its copy to the device does not wait."""
    rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return None
    bitmask = _full_bitmask(len(seqs), vocab_size, pin)
    fill_rows(bitmask, [(row, seqs[row].grammar) for row in rows])
    return bitmask, rows


def fill_rows(bitmask: torch.Tensor, rows: Sequence[tuple[int, GrammarState | None]]) -> None:
    """Fill each ``(row, grammar)``'s row of ``bitmask``: xgrammar's matchers in one call on its threads, any
    other grammar (a reasoning gate) alone."""
    import xgrammar

    matchers, indices = [], []
    for row, grammar in rows:
        if isinstance(grammar, Replayed) and grammar.replayed:
            grammar = grammar.grammar
        if isinstance(grammar, xgrammar.GrammarMatcher):
            matchers.append(grammar)
            indices.append(row)
        elif grammar is not None:
            grammar.fill_next_token_bitmask(bitmask, row)
    if matchers:
        _batch_matcher().batch_fill_next_token_bitmask(matchers, bitmask, indices)


def accept_tokens(pairs: Sequence[tuple[GrammarState, int]]) -> list[bool]:
    """Each grammar takes its token: xgrammar's matchers in one call, any other grammar alone."""
    import xgrammar

    matchers = [grammar for grammar, _ in pairs if isinstance(grammar, xgrammar.GrammarMatcher)]
    if len(matchers) == len(pairs):
        return xgrammar.BatchGrammarMatcher.batch_accept_token(matchers, [token for _, token in pairs])
    return [grammar.accept_token(token) for grammar, token in pairs]


_local = threading.local()  # a batch matcher per thread: engines on different threads fill at once


def _batch_matcher() -> xgrammar.BatchGrammarMatcher:
    if not hasattr(_local, "matcher"):
        import xgrammar

        _local.matcher = xgrammar.BatchGrammarMatcher("auto")  # half the host's cores
    return _local.matcher


def apply_grammar_bitmask(logits: torch.Tensor, mask: Bitmask) -> None:
    """Set the disallowed tokens' logits to -inf, in place (``logits`` [N, V], a row per sample)."""
    import xgrammar

    bitmask, rows = mask
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)


def _full_bitmask(num_rows: int, vocab_size: int, pin: bool) -> torch.Tensor:
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin)


class RoundGrammars:
    """The grammar masks of one multi-step round (``apply`` before each step's token choice, ``sampled`` after
    it). Row i takes ``num_steps[i]`` steps: past them, and once its grammar has ended, a row keeps every bit
    set (the scheduler drops those tokens)."""

    def __init__(self, seqs: Sequence[Seq], num_steps: list[int], device: torch.device) -> None:
        self.seqs, self.num_steps, self.pin = seqs, num_steps, device.type == "cuda"
        self.forks: list[GrammarState | None] = []
        self.taken = [0] * len(seqs)  # the tokens each fork has taken
        self.bitmask = torch.empty(0, dtype=torch.int32)  # [B, ceil(V / 32)], made at the first step
        self.tokens = torch.empty(len(seqs), dtype=torch.long, pin_memory=self.pin)  # the last step's, on the host
        self.event = torch.cuda.Event() if self.pin else None

    @staticmethod
    def of(seqs: Sequence[Seq], num_steps: list[int], device: torch.device) -> RoundGrammars | None:
        """None when no row follows a grammar."""
        if all(seq.grammar is None for seq in seqs):
            return None
        return RoundGrammars(seqs, num_steps, device)

    def apply(self, step: int, logits: torch.Tensor) -> None:
        """Mask step ``step``'s logits [B, V] in place; call it once that step's forward is queued."""
        if step == 0:  # forked here, while the first forward runs
            self.forks = [None if seq.grammar is None else seq.grammar.fork() for seq in self.seqs]
            self.bitmask = _full_bitmask(len(self.seqs), logits.shape[-1], self.pin)
        else:
            if self.event is not None:
                self.event.synchronize()  # the last step's tokens, not this step's forward
            tokens = self.tokens.tolist()
            taking = list(self._live(step - 1))
            for (row, _), accepted in zip(taking, accept_tokens([(g, tokens[row]) for row, g in taking])):
                if not accepted:
                    raise RuntimeError(f"a multi-step round sampled a token row {row}'s grammar refuses")
                self.taken[row] += 1
        self.bitmask.fill_(-1)
        fill_rows(self.bitmask, [(row, g) for row, g in self._live(step)])
        apply_grammar_bitmask(logits, (self.bitmask, None))

    def advanced(self, token_rows: list[list[int]]) -> list[GrammarState | None]:
        """Each row's grammar after the round's tokens (``token_rows[i]``: row i's), for the scheduler to take in
        place of the sequence's own: the forks have taken all but the last step's tokens, and replay those."""
        return [
            None if grammar is None else Replayed(grammar, tokens[:taken])
            for grammar, tokens, taken in zip(self.forks, token_rows, self.taken)
        ]

    def _live(self, step: int) -> Iterator[tuple[int, GrammarState]]:
        """The rows whose grammar chooses step ``step``'s token: within their steps, grammar not ended."""
        for row, grammar in enumerate(self.forks):
            if grammar is not None and step < self.num_steps[row] and not grammar.is_terminated():
                yield row, grammar

    def sampled(self, tokens: torch.Tensor) -> None:
        """Step's tokens [B] (on the device): copied to the host behind them, for the next step's masks."""
        self.tokens.copy_(tokens, non_blocking=True)
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(tokens.device))


class Replayed:
    """A grammar that a round's first ``tokens`` already advanced. Taking those tokens again only checks them
    against the record; later ones go to the grammar."""

    def __init__(self, grammar: GrammarState, tokens: list[int]) -> None:
        self.grammar, self.tokens, self.cursor = grammar, tokens, 0

    def accept_token(self, token_id: int) -> bool:
        if self.cursor < len(self.tokens):
            self.cursor += 1
            return token_id == self.tokens[self.cursor - 1]
        return self.grammar.accept_token(token_id)

    @property
    def replayed(self) -> bool:
        return self.cursor >= len(self.tokens)

    def is_terminated(self) -> bool:  # a grammar that ended did so on the last token it took
        return self.replayed and self.grammar.is_terminated()

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> object:
        return self.grammar.fill_next_token_bitmask(bitmask, index)

    def fork(self) -> GrammarState:
        return self.grammar.fork()
