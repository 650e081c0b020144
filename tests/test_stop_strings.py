"""Stop strings as a KMP automaton per string: whatever pieces the text arrives in, the first stop string found and
the tail held back from a stream equal their definitions, computed here from the whole text."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from paged_backend.engine.stop_strings import StopStrings, failure_table
from paged_backend.sampling_params import MAX_STOP_CHARS, SamplingParams

texts = st.text(alphabet="abc", max_size=40)
stop_lists = st.lists(st.text(alphabet="abc", min_size=1, max_size=6), min_size=1, max_size=4)


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The stop string whose first occurrence ends first (the longer on a tie), as (start, string)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return end - len(stop), stop
    return None


def held(text: str, stops: list[str]) -> int:
    """The longest tail of ``text`` that is a proper prefix of a stop string."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


@given(texts, stop_lists, st.lists(st.integers(1, 7), min_size=1))
def test_pieces_in_any_cut_find_what_the_whole_text_has(text: str, stops: list[str], cuts: list[int]) -> None:
    matcher, states, end, found = StopStrings(stops), None, 0, None
    states = matcher.start()
    i = 0
    while i < len(text) and found is None:
        piece = text[i : i + cuts[i % len(cuts)]]
        i += len(piece)
        found = matcher.feed(states, piece, i)
        end = i
        if found is None:
            assert matcher.held_back(states) == held(text[:end], stops)
    assert found == first_stop(text, stops)


@given(st.text(alphabet="ab", min_size=1, max_size=30))
def test_the_failure_table_is_its_definition(stop: str) -> None:
    expected = [
        max(k for k in range(i + 1) if stop[:k] == stop[i + 1 - k : i + 1] and k <= i) for i in range(len(stop))
    ]
    assert failure_table(stop) == expected


def test_text_before_min_tokens_moves_the_states_without_a_match() -> None:
    matcher = StopStrings(["abc"])
    states = matcher.start()
    assert matcher.feed(states, "xab", 3, report=False) is None and matcher.held_back(states) == 2
    assert matcher.feed(states, "c", 4) == (1, "abc")


def test_stop_strings_have_a_total_length_bound() -> None:
    SamplingParams(stop=["a" * (MAX_STOP_CHARS // 2)] * 2)
    with pytest.raises(ValueError, match=f"stop strings may have {MAX_STOP_CHARS} characters together") as info:
        SamplingParams(stop=["a" * (MAX_STOP_CHARS // 2), "b" * (MAX_STOP_CHARS // 2 + 1)])
    assert info.value.field == "stop"  # type: ignore[attr-defined]


@given(texts, stop_lists, st.integers(0, 40), st.lists(st.integers(1, 7), min_size=1))
@example("Hi\n\n\n", ["\n\n"], 4, [4, 1])  # "\n\n" completed uncounted, then one more "\n" stops it
def test_text_before_min_tokens_is_held_back_as_any_other(text: str, stops: list[str], counted: int, cuts) -> None:
    """The first ``counted`` characters cannot stop the sample (``min_tokens``), yet a stop string they complete
    may go on into one that does: what may still become a stop string is held back all along, so a stream never
    shows text that the final answer cuts."""
    matcher, states, i, found = StopStrings(stops), None, 0, None
    states = matcher.start()
    while i < len(text) and found is None:
        piece = text[i : i + cuts[i % len(cuts)]]
        i += len(piece)
        found = matcher.feed(states, piece, i, report=i > counted)
        if found is None:
            assert matcher.held_back(states) == held(text[:i], stops)
