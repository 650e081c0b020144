"""Stop strings matched as a sample's text grows, at a cost per step of the new text alone.

Each stop string is a Knuth-Morris-Pratt automaton (its failure table built once per request); a sample keeps,
per stop string, how many of its first characters the text's tail spells. A new character moves each state in
amortized constant time, so neither the strings' length nor the text's makes a step slower: rescanning the tail
for every possible stop-string start costs the square of the string's length each step, which a request with a
few long stop strings and many samples turns into minutes of every other request's time. The same states say
how much of the tail to hold back from a stream (it may still become a stop string).
"""

from __future__ import annotations


def failure_table(stop: str) -> list[int]:
    """``table[i]``: the length of the longest proper prefix of ``stop[: i + 1]`` that is also its suffix."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return table


class StopStrings:
    """A request's stop strings and their failure tables (shared by its samples)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [stop for stop in stops if stop]
        self.tables = [failure_table(stop) for stop in self.stops]

    def start(self) -> list[int]:
        """A sample's states before any text."""
        return [0] * len(self.stops)

    def feed(self, states: list[int], text: str, end: int, report: bool = True) -> tuple[int, str] | None:
        """Advance ``states`` over ``text``, the characters that end at offset ``end`` of the sample's text: the
        first stop string completed, as (its start offset, the string), or None (always, without ``report``: the
        text before ``min_tokens``, or a stop token's). Of two completed by the same character, the longer (the
        one that starts first) wins."""
        base = end - len(text)
        for offset, char in enumerate(text):
            found: str | None = None
            for j, stop in enumerate(self.stops):
                k, table = states[j], self.tables[j]
                if k == len(stop):  # a match already reported: go on from its border
                    k = table[k - 1]
                while k and stop[k] != char:
                    k = table[k - 1]
                if stop[k] == char:
                    k += 1
                states[j] = k
                if k == len(stop) and (found is None or len(stop) > len(found)):
                    found = stop
            if found is not None and report:
                return base + offset + 1 - len(found), found
        return None

    def held_back(self, states: list[int]) -> int:
        """How many characters at the text's end may still start a stop string (a proper prefix's length). A state
        at a whole match (one before ``min_tokens``, not reported) goes on from its border, which a next character
        can extend into a match: that border is held back too."""
        return max(
            (table[k - 1] if k == len(stop) else k for k, stop, table in zip(states, self.stops, self.tables)),
            default=0,
        )
