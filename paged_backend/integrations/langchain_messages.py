"""LangChain messages as the chat template takes them, and tool calling for ``ChatPagedBackend``: LangChain's
``tool_choice`` values as the engine's modes, and tool calls read back as LangChain's ``tool_calls`` (whole) or
``tool_call_chunks`` (streamed)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.tool import ToolCall as LCToolCall
from langchain_core.messages.tool import ToolCallChunk

from paged_backend.reasoning import ReasoningSplitter, split_reasoning
from paged_backend.tool_calls import ToolCall, ToolCallReader, ToolStream

_ROLES = ((HumanMessage, "user"), (AIMessage, "assistant"), (SystemMessage, "system"), (ToolMessage, "tool"))


def conversation(messages: list[BaseMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: an AI message's tool calls (arguments as objects, as vLLM hands
    them over) and a tool message's ``tool_call_id`` included."""
    turns = []
    for message in messages:
        turn: dict[str, Any] = {"role": role(message), "content": text(message.content)}
        if isinstance(message, AIMessage) and message.tool_calls:
            turn["tool_calls"] = [
                {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["args"]}}
                for call in message.tool_calls
            ]
        if isinstance(message, ToolMessage):
            turn["tool_call_id"] = message.tool_call_id
        turns.append(turn)
    return turns


def role(message: BaseMessage) -> str:
    """The chat-template role of a message, chunks included (an aggregated stream is an ``AIMessageChunk``)."""
    if isinstance(message, ChatMessage):
        return message.role
    for cls, name in _ROLES:
        if isinstance(message, cls):
            return name
    raise ValueError(f"message type {message.type!r} is not supported: use Human, AI, System, Tool or ChatMessage")


def text(content: str | list[Any]) -> str:
    """A message's text: a string, or the text blocks of a content list (other blocks are refused)."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block["text"])
        elif isinstance(block, dict) and block.get("type") == "tool_use":
            continue  # Anthropic-style histories repeat a call in the content: the call itself is in tool_calls
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"only text content is supported, got a {kind!r} block")
    return "".join(parts)


def tool_mode(tool_choice: Any, names: list[str]) -> str:
    """LangChain's ``tool_choice`` as the engine's mode: None / ``"auto"`` -> ``"auto"``; ``"any"``,
    ``"required"`` or True -> ``"required"``; ``"none"``; a tool's name or ``{"function": {"name": ...}}`` ->
    that name."""
    if tool_choice is None or tool_choice == "auto":
        return "auto"
    if tool_choice in ("any", "required") or tool_choice is True:
        return "required"
    if tool_choice == "none":
        return "none"
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else tool_choice
    if not isinstance(name, str) or name not in names:
        raise ValueError(
            f"tool_choice must be 'auto', 'any', 'required', 'none', True or one of the tools {names}, "
            f"got {tool_choice!r}"
        )
    return name


def split_output(
    text: str, reasoning_parser: str | None, reader: ToolCallReader
) -> tuple[str | None, str, list[ToolCall]]:
    """A whole output's (reasoning, content, tool calls): the thinking first, then the calls in the rest."""
    reasoning = None
    if reasoning_parser is not None:
        reasoning, text = split_reasoning(reasoning_parser, text)
    content, calls = reader.split(text)
    return reasoning, content or "", calls


@dataclass
class OutputStream:
    """A streamed output, piece by piece: its thinking split off, then text that may begin a tool call held."""

    reader: ToolCallReader
    reasoning_parser: str | None
    splitter: ReasoningSplitter | None = field(init=False)
    tools: ToolStream | None = field(init=False)

    def __post_init__(self) -> None:
        self.splitter = ReasoningSplitter(self.reasoning_parser) if self.reasoning_parser else None
        self.tools = self.reader.streamer()

    def feed(self, piece: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        """The new (reasoning, content) text and, at the end, the calls."""
        reasoning = ""
        if self.splitter is not None:
            reasoning, piece = self.splitter.feed(piece, final=final)
        calls: list[ToolCall] = []
        if self.tools is not None:
            piece, calls = self.tools.feed(piece, final=final)
        return reasoning, piece, calls


def lc_tool_calls(calls: list[ToolCall]) -> list[LCToolCall]:
    return [LCToolCall(name=c.name, args=json.loads(c.arguments), id=c.id, type="tool_call") for c in calls]


def lc_tool_call_chunks(calls: list[ToolCall]) -> list[ToolCallChunk]:
    """Each call whole, in one chunk."""
    return [
        ToolCallChunk(name=c.name, args=c.arguments, id=c.id, index=i, type="tool_call_chunk")
        for i, c in enumerate(calls)
    ]
