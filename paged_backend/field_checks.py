"""Checks of one configuration or request field each: a bad value is a ``FieldError`` that names the field and
says what is allowed (the server reports the name as OpenAI's ``param``)."""

from __future__ import annotations

from typing import Any


class FieldError(ValueError):
    """A bad value of one named field. ``field`` is the field's name (without an index such as ``[i]``), which
    the server reports as OpenAI's ``param``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field.split("[", 1)[0]


def check_int(name: str, value: Any, low: int, high: int | None = None, allow_none: bool = False) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is an int in ``[low, high]``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        if allow_none:
            allowed += " or None"
        raise FieldError(name, f"{name} must be {allowed}, got {value!r}")


def check_float(
    name: str,
    value: Any,
    low: float,
    high: float,
    low_open: bool = False,
    high_open: bool = False,
    allow_none: bool = False,
) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is a real number inside the interval."""
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise FieldError(name, f"{name} must be a number in {interval}, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise FieldError(name, f"{name} must be True or False, got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[object, ...]) -> None:
    if value not in choices:
        raise FieldError(name, f"{name} must be one of {list(choices)}, got {value!r}")
