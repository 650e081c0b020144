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


@dataclass
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
            return [self._entry(i) for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"prompt_logprobs index {index} out of range for {len(self)} prompt tokens")
        return self._entry(index % len(self))

    def __iter__(self) -> Iterator[PromptLogprob]:
        return (self._entry(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PromptLogprobs({list(self)!r})"

    def _entry(self, position: int) -> PromptLogprob:
        if position == 0:
            return None
        if self._rows is None:  # one conversion of the arrays, on the first read
            a = self._arrays
            assert a is not None, "positions after the first exist only with arrays"
            self._rows = (a.token_ids.tolist(), a.logprobs.tolist(), a.ranks.tolist())
        id_rows, value_rows, ranks = self._rows
        ids, values = id_rows[position - 1], value_rows[position - 1]
        entry = {ids[0]: Logprob(values[0], ranks[position - 1], self._text(ids[0]))}
        for j in range(1, len(ids)):  # the top k: the following token again when it is among them
            entry[ids[j]] = Logprob(values[j], j, self._text(ids[j]))
        return entry

    def _text(self, token_id: int) -> str | None:
        if self._decode is None:
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode(token_id)
        return text
