"""Tool-call parsers (vLLM's ``--tool-call-parser``): a chat model's text into its content and the tool calls it
wrote, whole or as a stream.

``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number,
after optional content. ``llama3_json`` (Llama 3.1+): the whole output is ``{"name": ..., "parameters": {...}}``
(``arguments`` also read), several joined by ``;``, maybe after ``<|python_tag|>``. ``mistral``: ``[TOOL_CALLS]``
then a JSON list of ``{"name": ..., "arguments": {...}}``, after optional content. A call that does not parse
leaves the whole text as content: a model that wrote the marker and then something else gets its text back,
never a half-made call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from paged_backend import json_limits

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_START = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's ``function.arguments``)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def infer_tool_call_parser(chat_template: str) -> str | None:
    """The parser whose marker a chat template writes calls with (Hermes / Qwen ``<tool_call>``, Mistral
    ``[TOOL_CALLS]``, Llama 3.1+ ``<|python_tag|>``), or None."""
    return next((parser for parser, marker in _START.items() if marker in chat_template), None)


def check_parser(parser: str) -> str:
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool call parser must be one of {list(TOOL_CALL_PARSERS)}, got {parser!r}")
    return parser


def parse_tool_calls(parser: str, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
    """``(content or None, calls)`` of a whole output; no calls: ``(text, [])``. ``cut``: the output was cut short
    (``max_tokens``), so the calls that completed count and the one being written is dropped, never content."""
    check_parser(parser)
    if parser == "llama3_json":
        body = text.strip().removeprefix(_START["llama3_json"]).strip()
        calls = _json_calls(_json_objects(body, cut) if body.startswith("{") else None, "parameters")
        if calls is None:
            return (None, []) if cut and body.startswith("{") else (text, [])
        return None, calls
    at = text.find(_START[parser])
    if at < 0:
        return text, []
    values: list[Any] | None
    if parser == "hermes":
        values = [_loads(m.group(1)) for m in _HERMES_CALL.finditer(text, at)]
        if cut and values and values[-1] is None:  # the call the output stopped in
            values.pop()
    else:
        rest = text[at + len(_START[parser]) :].strip()
        listed = _loads(rest)
        if listed is None and cut:
            listed = [value for value, _ in whole_list_items(rest)]
        values = listed if isinstance(listed, list) else None
    calls = _json_calls(values, "arguments")
    if calls is None:
        return (text[:at].strip() or None, []) if cut else (text, [])
    return text[:at].strip() or None, calls


def whole_list_items(text: str) -> list[tuple[Any, tuple[int, int]]]:
    """The items of a JSON list that are whole, from the start of ``text`` (which may end anywhere), each with
    its span in ``text``."""
    i = len(text) - len(text.lstrip())
    if not text.startswith("[", i):
        return []
    items: list[tuple[Any, tuple[int, int]]] = []
    i += 1
    while True:
        while i < len(text) and text[i] in " \t\n\r,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return items
        try:
            value, end = json_limits.raw_decode(text, i)
        except ValueError:
            return items
        items.append((value, (i, end)))
        i = end


def _loads(text: str) -> Any:
    try:
        return json_limits.loads(text)
    except ValueError:
        return None


def _json_objects(text: str, cut: bool = False) -> list[Any] | None:
    """JSON values joined by ``;`` (Llama 3's parallel calls), or None if the text is not that (``cut``: the
    values before one the output stopped in)."""
    at = 0
    values: list[Any] = []
    while True:
        try:
            value, at = json_limits.raw_decode(text, at)
        except ValueError:
            return (values or None) if cut else None
        values.append(value)
        rest = text[at:].lstrip()
        if not rest:
            return values
        if not rest.startswith(";"):
            return None
        at = len(text) - len(rest[1:].lstrip())


def _json_calls(values: list[Any] | None, arguments_key: str) -> list[ToolCall] | None:
    """Each value a ``{"name": str, arguments_key or "arguments": object}``; None if any is not."""
    if not values:
        return None
    calls = []
    for value in values:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get(arguments_key, value.get("arguments", {}))
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


@dataclass
class ToolCallStreamer:
    """A stream's text, fed piece by piece: content is passed on until a tool call may begin, then held; the
    calls come out when the output ends (or, if what followed the marker was not a call, the held text as
    content)."""

    parser: str
    text: str = ""
    sent: int = 0  # characters of ``text`` passed on as content

    def __post_init__(self) -> None:
        check_parser(self.parser)

    def feed(self, piece: str, final: bool = False, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """The new content ``piece`` adds, and (when ``final``) the calls; ``cut``: the output stopped at
        ``max_tokens`` (see ``parse_tool_calls``)."""
        self.text += piece
        if final:
            content, calls = parse_tool_calls(self.parser, self.text, cut)
            if not calls and not (cut and content != self.text):
                return self._send(len(self.text)), []
            return self._send(self._safe_end()), calls  # content up to the first call
        return self._send(self._safe_end()), []

    def _safe_end(self) -> int:
        """How far the text is surely content: up to a tool call's start, or a suffix that could begin one."""
        marker = _START[self.parser]
        if self.parser == "llama3_json":  # a call is the whole output: decided by its first character
            stripped = self.text.lstrip()
            if not stripped or stripped.startswith("{") or marker.startswith(stripped[: len(marker)]):
                return 0
            return len(self.text)
        at = self.text.find(marker)
        if at >= 0:
            return at
        for n in range(min(len(marker) - 1, len(self.text)), 0, -1):
            if marker.startswith(self.text[-n:]):
                return len(self.text) - n
        return len(self.text)

    def _send(self, end: int) -> str:
        end = max(end, self.sent)
        piece, self.sent = self.text[self.sent : end], end
        return piece
