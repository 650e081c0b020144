"""Tool calls: parsing what a chat model wrote (``parsers``) and forcing a call with a grammar (``forced``)."""

from paged_backend.tool_calls.choice import (
    ToolCallReader,
    ToolStream,
    resolve_parser,
    tool_request,
)
from paged_backend.tool_calls.forced import forced_tool_format, parse_forced_tool_calls
from paged_backend.tool_calls.forced_stream import ForcedCallStreamer, ToolCallDelta
from paged_backend.tool_calls.parsers import (
    TOOL_CALL_PARSERS,
    ToolCall,
    ToolCallStreamer,
    check_parser,
    infer_tool_call_parser,
    parse_tool_calls,
)

__all__ = [
    "TOOL_CALL_PARSERS",
    "ForcedCallStreamer",
    "ToolCallReader",
    "ToolStream",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStreamer",
    "check_parser",
    "forced_tool_format",
    "infer_tool_call_parser",
    "parse_forced_tool_calls",
    "parse_tool_calls",
    "resolve_parser",
    "tool_request",
]
