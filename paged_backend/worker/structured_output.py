"""The grammar mask of a step's structured-output rows: filled on the host (each sample's matcher says which
tokens may come next) while the device runs the step's forward, then applied to the logits on the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged_backend.core.sequence import Sequence as Seq

Bitmask = tuple[torch.Tensor, list[int]]  # [rows, ceil(V / 32)] int32 (bit set: allowed), and the rows it covers


def fill_grammar_bitmask(seqs: Sequence[Seq], vocab_size: int) -> Bitmask | None:
    """The allowed tokens of every row whose sample follows a grammar (None when no row does). Rows without
    one keep every bit set."""
    rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return None
    bitmask = torch.full((len(seqs), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for row in rows:
        grammar = seqs[row].grammar
        assert grammar is not None
        grammar.fill_next_token_bitmask(bitmask, row)
    return bitmask, rows


def apply_grammar_bitmask(logits: torch.Tensor, mask: Bitmask) -> None:
    """Set the disallowed tokens' logits to -inf, in place (``logits`` [N, V], a row per sample)."""
    import xgrammar

    bitmask, rows = mask
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
