"""Log probabilities as vLLM reports them, and the arrays that carry prompt logprobs from the worker.

A scored prompt has one entry a token. Built as a ``dict`` of ``Logprob`` objects each, a 140k-token batch of
prompts is ~300k Python objects made inside the engine's step, where the GPU waits for them. So the worker
hands over arrays (``LogprobsArrays``, vLLM v1's ``LogprobsTensors`` on the host) and ``PromptLogprobs`` keeps
them: it reads as vLLM's ``[None, {token: Logprob}, ...]`` and builds a position's dict when it is read (as
vLLM's ``FlatLogprobs`` does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

TokenDecoder = Callable[[int], str]  # one token id's text


@dataclass(slots=True)
class Logprob:
    """One entry of a per-token top-k dict: log probability, rank (1 = most likely), decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class LogprobsArrays:
    """Logprobs at ``n`` positions: column 0 is the token that follows each position, columns ``1..k`` the
    position's top k (most likely first, rank ``j`` in column ``j``); ``ranks`` is the following token's rank."""

    token_ids: npt.NDArray[np.int64]  # [n, 1 + k]
    logprobs: npt.NDArray[np.float32]  # [n, 1 + k]
    ranks: npt.NDArray[np.int64]  # [n]

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @staticmethod
    def concat(parts: Sequence[LogprobsArrays]) -> LogprobsArrays:
        """The positions of ``parts``, in order (their k alike)."""
        import numpy as np  # here, not at import: importing the package stays light

        return LogprobsArrays(
            np.concatenate([p.token_ids for p in parts]),
            np.concatenate([p.logprobs for p in parts]),
            np.concatenate([p.ranks for p in parts]),
        )

    def take(self, start: int, stop: int, k: int | None = None) -> LogprobsArrays:
        """Positions ``start:stop``, with their top ``k`` only when given."""
        columns = slice(None) if k is None else slice(0, 1 + k)
        return LogprobsArrays(
            self.token_ids[start:stop, columns], self.logprobs[start:stop, columns], self.ranks[start:stop]
        )


PromptLogprob = dict[int, Logprob] | None


class PromptLogprobs(Sequence[PromptLogprob]):
    """vLLM's ``prompt_logprobs``: ``None`` for the first prompt token, then for each next token a dict holding
    that token (its logprob and rank) and the top k. A position's dict is built each time it is read."""

    def __init__(self, arrays: LogprobsArrays | None, decode: TokenDecoder | None = None) -> None:
        self._arrays = arrays
        self._decode = decode
        self._rows: tuple[list[list[int]], list[list[float]], list[int]] | None = None
        self._texts: dict[int, str] = {}

    def __len__(self) -> int:
        return 1 + (len(self._arrays) if self._arrays is not None else 0)

    @overload
    def __getitem__(self, index: int) -> PromptLogprob: ...

    @overload
    def __getitem__(self, index: slice) -> list[PromptLogprob]: ...

    def __getitem__(self, index: int | slice) -> PromptLogprob | list[PromptLogprob]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return self._entries(start, max(start, stop))
            return [self._entries(i, i + 1)[0] for i in range(start, stop, step)]
        if not -len(self) <= index < len(self):
            raise IndexError(f"prompt_logprobs index {index} out of range for {len(self)} prompt tokens")
        position = index % len(self)
        return self._entries(position, position + 1)[0]

    def __iter__(self) -> Iterator[PromptLogprob]:
        for start in range(0, len(self), _ENTRIES_PER_READ):
            yield from self._entries(start, min(start + _ENTRIES_PER_READ, len(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PromptLogprobs({list(self)!r})"

    def _entries(self, start: int, stop: int) -> list[PromptLogprob]:
        """Positions ``start:stop`` (``0 <= start <= stop <= len``), built in one loop: reading a long prompt's
        entries is the caller's Python work, a few hundred thousand objects for a batch of scored prompts."""
        entries: list[PromptLogprob] = [None] if start == 0 < stop else []
        if self._rows is None:  # one conversion of the arrays, on the first read
            a = self._arrays
            if a is None:
                return entries
            self._rows = (a.token_ids.tolist(), a.logprobs.tolist(), a.ranks.tolist())
        id_rows, value_rows, ranks = self._rows
        rows = slice(max(start, 1) - 1, stop - 1)
        text = self._texts_for(id_rows[rows])
        for ids, values, rank in zip(id_rows[rows], value_rows[rows], ranks[rows]):
            entry = {ids[0]: Logprob(values[0], rank, text(ids[0]) if text else None)}
            for j in range(1, len(ids)):  # the top k: the following token again when it is among them
                entry[ids[j]] = Logprob(values[j], j, text(ids[j]) if text else None)
            entries.append(entry)
        return entries

    def _texts_for(self, id_rows: list[list[int]]) -> Callable[[int], str] | None:
        """A lookup of the decoded text of every token in ``id_rows`` (each token decoded once); ``None`` without
        a decoder."""
        if self._decode is None:
            return None
        texts = self._texts
        for ids in id_rows:
            for token_id in ids:
                if token_id not in texts:
                    texts[token_id] = self._decode(token_id)
        return texts.__getitem__


_ENTRIES_PER_READ = 1024  # positions built at a time when iterating
