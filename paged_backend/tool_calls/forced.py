"""``tool_choice`` ``"required"`` and a named function, held by a grammar so that the output always parses: a
named function's output is its arguments, a JSON object of its ``parameters`` schema; ``"required"``'s is a
JSON list of one or more ``{"name": ..., "parameters": {...}}`` objects, each one of the tools (one only when
parallel calls are off) — the shapes vLLM uses. The JSON is compact (no whitespace between its tokens): a
model under the grammar cannot spend its tokens on blank space.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from paged_backend.sampling_params import StructuredOutputsParams
from paged_backend.tool_calls.parsers import ToolCall

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def forced_tool_format(
    tools: Mapping[str, Mapping[str, Any] | None], choice: str, parallel: bool = True
) -> StructuredOutputsParams:
    """The output format for ``choice`` (``"required"`` or a function's name) over ``tools`` (name -> its
    ``parameters`` schema, None for none)."""
    if choice != "required":
        return StructuredOutputsParams(json=dict(tools[choice] or ANY_OBJECT), disable_any_whitespace=True)
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": dict(schema or ANY_OBJECT)},
            "required": ["name", "parameters"],
        }
        for name, schema in tools.items()
    ]
    listed: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        listed["maxItems"] = 1
    return StructuredOutputsParams(json=listed, disable_any_whitespace=True)


def parse_forced_tool_calls(choice: str, text: str) -> list[ToolCall]:
    """The calls in an output made under :func:`forced_tool_format` (none if it was cut short)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if choice != "required":
        return [ToolCall(choice, json.dumps(value, ensure_ascii=False))] if isinstance(value, dict) else []
    if not isinstance(value, Sequence) or not all(isinstance(call, dict) for call in value):
        return []
    return [ToolCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in value]
