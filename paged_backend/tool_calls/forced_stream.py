"""A forced call's output (``forced.py``'s format) read as it streams: each call's name as soon as it is written,
then its arguments piece by piece as the grammar emits them, as OpenAI streams ``function.arguments`` (clients such
as instructor's partial streaming build objects from those pieces).

A named function's output is its arguments object, streamed from the first character. ``"required"``'s is a
compact JSON list of ``{"name": ..., "parameters": {...}}``: a call is announced once its name and the start of
its parameters are read, and the parameters object is passed on up to its closing brace (a scan that follows
strings and nesting). Cut short (``max_tokens``), the calls that completed are whole; the last one's pieces stop
where the output did.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace

from paged_backend.tool_calls.forced import CALL_HEAD, parse_forced_tool_calls
from paged_backend.tool_calls.parsers import ToolCall, new_tool_call_id

_FIRST = re.compile(r"\s*\[\s*" + CALL_HEAD.pattern)  # the list's first call, up to its parameters
_NEXT = re.compile(r"\s*\}\s*,\s*" + CALL_HEAD.pattern)  # from the end of a call's parameters to the next's


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a stream's ``delta.tool_calls``: a call's first piece carries its id and name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, object]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass
class ForcedCallStreamer:
    """``feed`` gives whole calls when the output ends (adapters that show calls whole); ``feed_deltas`` the
    pieces as they come (the server's stream). A stream uses one of the two."""

    mode: str
    text: str = ""
    calls: int = 0  # calls announced
    scanned: int = 0  # characters of ``text`` read by the delta scan
    call_start: int = 0  # where the text before the next call's head starts
    reading: bool = False  # inside a call whose head was announced, until its arguments close
    started: bool = False  # the current call's arguments have begun (whitespace before them is not passed on)
    depth: int = 0  # nesting inside the current arguments object
    in_string: bool = False
    escaped: bool = False
    ids: list[str] = field(default_factory=list)

    def feed(self, piece: str, final: bool = False, cut: bool = False) -> tuple[str, list[ToolCall]]:
        self.text += piece
        return ("", parse_forced_tool_calls(self.mode, self.text)) if final else ("", [])

    def feed_deltas(self, piece: str, final: bool = False) -> list[ToolCallDelta]:
        """The new pieces, one per call: clients read a chunk's ``delta.tool_calls`` one entry per index (a call's
        head and its first arguments arrive together, as OpenAI sends them)."""
        merged: list[ToolCallDelta] = []
        for delta in self._deltas(piece, final):
            if merged and merged[-1].index == delta.index:
                last = merged.pop()
                delta = replace(last, arguments=last.arguments + delta.arguments)
            merged.append(delta)
        return merged

    def _deltas(self, piece: str, final: bool) -> list[ToolCallDelta]:
        self.text += piece
        if final and self.mode == "required" and not self.calls:  # the calls were not laid out as expected: whole
            calls = parse_forced_tool_calls(self.mode, self.text)
            return [ToolCallDelta(i, call.arguments, call.id, call.name) for i, call in enumerate(calls)]
        if self.mode != "required":  # the whole output is the named function's arguments
            first = [] if self.calls else [self._announce(self.mode)]
            piece = self._arguments(piece)
            return first + ([ToolCallDelta(0, piece)] if piece else [])
        deltas: list[ToolCallDelta] = []
        while True:
            if not self.reading:  # between calls: wait for the next call's head
                head = (_NEXT if self.calls else _FIRST).match(self.text, self.call_start)
                if head is None:
                    break
                deltas.append(self._announce(json.loads(head.group(1))))
                self.scanned, self.reading = head.end(), True
            start = self.scanned
            closed = self._scan()
            piece = self._arguments(self.text[start : self.scanned])
            if piece:
                deltas.append(ToolCallDelta(self.calls - 1, piece))
            if not closed:
                break
            self.reading, self.call_start = False, self.scanned
        return deltas

    def _arguments(self, piece: str) -> str:
        """A piece of the current call's arguments, less the whitespace before they begin."""
        if not self.started:
            piece = piece.lstrip()
            self.started = bool(piece)
        return piece

    def _announce(self, name: str) -> ToolCallDelta:
        self.ids.append(new_tool_call_id())
        self.calls += 1
        self.started = False
        return ToolCallDelta(self.calls - 1, "", self.ids[-1], name)

    def _scan(self) -> bool:
        """Read the arguments object on from ``scanned`` until it closes (True: ``scanned`` is just past its
        closing brace) or the text ends (False)."""
        i = self.scanned
        closed = False
        while i < len(self.text) and not closed:
            char = self.text[i]
            i += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                closed = self.depth == 0
        self.scanned = i
        return closed
