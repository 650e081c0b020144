"""How one request's outputs are read for tool calls, whoever asked (the server's ``tool_choice``, LangChain's
``bind_tools``): ``mode`` None or ``"none"`` (nothing is read), ``"auto"`` (a parser reads the model's text),
``"required"`` or a function's name (the output is a forced format, ``forced.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from paged_backend.tool_calls.forced import parse_forced_tool_calls
from paged_backend.tool_calls.parsers import ToolCall, ToolCallStreamer, check_parser, parse_tool_calls


class ToolStream(Protocol):
    def feed(self, piece: str, final: bool = False) -> tuple[str, list[ToolCall]]: ...


@dataclass
class ForcedCallStreamer:
    """A forced call's stream: its JSON is held until the output ends (then the calls, or, cut short, the text)."""

    mode: str
    text: str = ""

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.text += piece
        if not final:
            return "", []
        calls = parse_forced_tool_calls(self.mode, self.text)
        return ("", calls) if calls else (self.text, [])


@dataclass(frozen=True)
class ToolCallReader:
    """``mode`` as above; ``parser`` the tool-call parser (needed for ``"auto"`` only)."""

    mode: str | None
    parser: str | None = None

    def __post_init__(self) -> None:
        if self.mode == "auto":
            if self.parser is None:
                raise ValueError("tool choice 'auto' needs a tool call parser to read the model's text")
            check_parser(self.parser)

    @property
    def active(self) -> bool:
        return self.mode not in (None, "none")

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output's ``(content, calls)``."""
        if self.mode == "auto":
            return parse_tool_calls(str(self.parser), text)
        if self.active:
            calls = parse_forced_tool_calls(str(self.mode), text)
            return (None, calls) if calls else (text, [])
        return text, []

    def streamer(self) -> ToolStream | None:
        if self.mode == "auto":
            return ToolCallStreamer(str(self.parser))
        return ForcedCallStreamer(str(self.mode)) if self.active else None

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """OpenAI's: ``tool_calls`` when the model chose to call (a named function forced is a ``stop``)."""
        if called and reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason
