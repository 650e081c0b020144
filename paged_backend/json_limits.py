"""JSON parsed with a bound on its nesting, wherever the input comes from a client or from the model's output.

Python's parser recurses once per level, so JSON nested some thousand levels deep raises RecursionError (not a
ValueError), and anything that walks a deep value afterwards (a chat template's ``tojson``, a schema compiler)
recurses as deep again. Here every parse is held to ``MAX_JSON_DEPTH`` levels, the depth xgrammar and most JSON
Schema tools accept, and going past it is a ``JSONTooDeep``: a ValueError, which every caller already handles as
"not valid JSON" or turns into a 400 naming its field.
"""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 64
_DECODER = json.JSONDecoder()
_SCALARS = frozenset({str, int, float, bool, type(None)})


class JSONTooDeep(ValueError):
    """JSON nested deeper than the bound (or than the parser can go)."""

    def __init__(self, max_depth: int) -> None:
        super().__init__(f"nests deeper than {max_depth} levels of arrays and objects")


def check_depth(value: Any, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``value`` (already parsed, e.g. a request body's object), or JSONTooDeep if its arrays and objects nest
    deeper than ``max_depth``; walked without recursion, and only as deep as the bound. A container whose
    children are all scalars (a long enum) is passed over by a set of their types, made in C: the server walks
    request bodies on its event loop, holding the GIL that the engine's thread takes back after every torch op."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list | tuple) else None
        if children is None:
            continue
        if level > max_depth:
            raise JSONTooDeep(max_depth)
        if not set(map(type, children)) <= _SCALARS:
            stack.extend((child, level + 1) for child in children if isinstance(child, dict | list | tuple))
    return value


def loads(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` held to ``max_depth`` levels: JSONTooDeep past it, ValueError for text that is not JSON."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JSONTooDeep(max_depth) from None
    return check_depth(value, max_depth)


def raw_decode(text: str, start: int = 0, max_depth: int = MAX_JSON_DEPTH) -> tuple[Any, int]:
    """``JSONDecoder.raw_decode`` (a JSON value at ``start`` and where it ends) held to ``max_depth`` levels."""
    try:
        value, end = _DECODER.raw_decode(text, start)
    except RecursionError:
        raise JSONTooDeep(max_depth) from None
    return check_depth(value, max_depth), end
