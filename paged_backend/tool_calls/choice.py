"""How one request's outputs are read for tool calls, whoever asked (the server's ``tool_choice``, LangChain's
``bind_tools``): ``mode`` None or ``"none"`` (nothing is read), ``"auto"`` (a parser reads the model's text),
``"required"`` or a function's name (the output is a forced format, ``forced.py``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from paged_backend.sampling_params import StructuredOutputsParams
from paged_backend.tool_calls.forced import forced_tool_format, parse_forced_tool_calls
from paged_backend.tool_calls.forced_stream import ForcedCallStreamer
from paged_backend.tool_calls.parsers import (
    ToolCall,
    ToolCallStreamer,
    check_parser,
    infer_tool_call_parser,
    parse_tool_calls,
)


class ToolStream(Protocol):
    def feed(self, piece: str, final: bool = False, cut: bool = False) -> tuple[str, list[ToolCall]]: ...


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

    def split(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """A whole output's ``(content, calls)``; ``cut``: it stopped at ``max_tokens`` (the calls that
        completed count, the one being written is dropped)."""
        if self.mode == "auto":
            return parse_tool_calls(str(self.parser), text, cut)
        if self.active:  # a forced output is calls, never text: cut short, the calls that completed
            return None, parse_forced_tool_calls(str(self.mode), text)
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


def tool_request(
    tools: Sequence[Mapping[str, Any]] | None, mode: str | None, parallel: bool, parser: Callable[[], str]
) -> tuple[StructuredOutputsParams | None, ToolCallReader]:
    """For OpenAI-format ``tools`` and a ``mode``: the grammar of a forced call (or None) and the reader of the
    outputs; ``parser()`` is asked for only under ``"auto"``."""
    if not tools or mode in (None, "none"):
        return None, ToolCallReader(None)
    if mode == "auto":
        return None, ToolCallReader("auto", parser())
    parameters = {tool["function"]["name"]: tool["function"].get("parameters") for tool in tools}
    return forced_tool_format(parameters, mode, parallel), ToolCallReader(mode)


def resolve_parser(parser: str | None, chat_template: object) -> str:
    """``parser`` if given, else the one whose marker ``chat_template`` uses; neither is a ``ValueError`` naming
    ``tool_call_parser``."""
    if parser is not None:
        return check_parser(parser)
    inferred = infer_tool_call_parser(chat_template if isinstance(chat_template, str) else "")
    if inferred is None:
        raise ValueError(
            "tool_choice 'auto' (the default) needs tool_call_parser='hermes' | 'llama3_json' | 'mistral': the chat "
            "template shows none of their markers; or force a call (tool_choice 'required' or a tool's name: a "
            "grammar then holds it)"
        )
    return inferred
