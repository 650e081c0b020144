"""``tool_choice`` ``"required"`` and a named function, held by a grammar so that the output always parses: a
named function's output is its arguments, a JSON object of its ``parameters`` schema; ``"required"``'s is a
JSON list of one or more ``{"name": ..., "parameters": {...}}`` objects, each one of the tools (one only when
parallel calls are off) — the shapes vLLM uses. The JSON is compact (no whitespace between its tokens): a
model under the grammar cannot spend its tokens on blank space.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from paged_backend import json_limits
from paged_backend.config import FieldError
from paged_backend.sampling_params import StructuredOutputsParams
from paged_backend.tool_calls.parsers import ToolCall, whole_list_items

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def forced_tool_format(
    tools: Mapping[str, Mapping[str, Any] | None], choice: str, parallel: bool = True
) -> StructuredOutputsParams:
    """The output format for ``choice`` (``"required"`` or a function's name) over ``tools`` (name -> its
    ``parameters`` schema, None for none)."""
    if choice != "required":
        return StructuredOutputsParams(json=dict(tools[choice] or ANY_OBJECT), disable_any_whitespace=True)
    defs: dict[str, Any] = {}
    calls = []
    for name, schema in tools.items():
        defs.update(_hoisted(name, dict(schema or ANY_OBJECT)))
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": {"$ref": _at(name)}},
                "required": ["name", "parameters"],
            }
        )
    listed: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": defs}
    if not parallel:
        listed["maxItems"] = 1
    return StructuredOutputsParams(json=listed, disable_any_whitespace=True)


def _at(name: str, definition: str | None = None) -> str:
    return f"#/$defs/{name}" if definition is None else f"#/$defs/{name}.{definition}"


def _hoisted(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema as root definitions of the list's schema: the schema itself under its name and
    its own ``$defs`` / ``definitions`` beside it, every local ``$ref`` rewritten to match (a Pydantic model's
    nested models are ``$ref: "#/$defs/Model"``, and ``"#"`` refers to the schema itself), so that refs written
    for the tool's schema as a root still resolve inside the list."""
    try:
        json_limits.check_depth(schema)  # before the walk below, which recurses
    except json_limits.JSONTooDeep as exc:
        raise FieldError("tools", f"tool {name}'s parameters {exc}") from None
    own: dict[str, Any] = {}
    for section in ("definitions", "$defs"):
        found = schema.pop(section, {})
        if not isinstance(found, dict):
            raise FieldError("tools", f"tool {name}'s parameters: {section} must be an object, got {found!r:.80}")
        own.update(found)

    def rewrite(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: _ref(v) if k == "$ref" and isinstance(v, str) else rewrite(v) for k, v in value.items()}
        return [rewrite(v) for v in value] if isinstance(value, list) else value

    def _ref(ref: str) -> str:
        for section in ("#/$defs/", "#/definitions/"):
            if ref.startswith(section):
                return _at(name, ref[len(section) :])
        return _at(name) + ref[1:] if ref.startswith("#") else ref

    return {_at(name)[len("#/$defs/") :]: rewrite(schema)} | {
        _at(name, key)[len("#/$defs/") :]: rewrite(value) for key, value in own.items()
    }


# A call of "required"'s list as the grammar writes it (keys in the schema's order), up to its parameters' value
CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')


def parse_forced_tool_calls(choice: str, text: str) -> list[ToolCall]:
    """The calls in an output made under :func:`forced_tool_format`, their arguments the text the model wrote
    (what a stream passes on piece by piece). Cut short (``max_tokens``), the calls that completed: a named
    function's arguments only when whole, ``"required"``'s list up to its last whole call."""
    if choice != "required":
        try:
            value = json_limits.loads(text)
        except ValueError:
            return []
        return [ToolCall(choice, text.strip())] if isinstance(value, dict) else []
    calls = []
    for call, (start, end) in whole_list_items(text):
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and "parameters" in call):
            continue
        head = CALL_HEAD.match(text, start)
        raw = text[head.end() : end - 1].rstrip() if head is not None else None
        calls.append(ToolCall(call["name"], raw if raw is not None else json.dumps(call["parameters"])))
    return calls
