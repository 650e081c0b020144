"""Tool calling on ``/v1/chat/completions``: OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, the
tools handed to the chat template, and the calls read back from each choice's text, whole or streamed.

``tool_choice`` (default ``"auto"`` with tools, as OpenAI's): ``"none"`` (the template still sees the tools, as
in vLLM; nothing is parsed), ``"auto"`` (the model decides; the server's ``--tool-call-parser`` reads its text,
so it needs ``--enable-auto-tool-choice``, as vLLM does), ``"required"`` or a named function (held by a grammar,
``paged_backend/tool_calls/forced.py``: the calls always parse).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from paged_backend import json_limits
from paged_backend.config import FieldError
from paged_backend.json_limits import JSONTooDeep
from paged_backend.sampling_params import StructuredOutputsParams
from paged_backend.tool_calls import ToolCall, ToolCallReader, forced_tool_format

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
FunctionName = str  # OpenAI's: letters, digits, _ and -, at most 64
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: FunctionName = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="a JSON schema of the arguments")
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


class ToolFields(BaseModel):
    """The request fields of tool calling (mixed into the chat request)."""

    tools: list[ChatTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description='"auto" when tools are given, else "none"'
    )
    parallel_tool_calls: bool = Field(default=True, description="false: at most one call (required: exactly one)")

    def tool_mode(self) -> str | None:
        """None without tools; else "none", "auto", "required" or the named function. ``FieldError`` for a
        choice without tools, or a name that is none of them."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise FieldError("tool_choice", "tool_choice other than 'none' needs tools")
            return None
        if isinstance(choice, NamedToolChoice):
            names = [tool.function.name for tool in self.tools]
            if choice.function.name not in names:
                raise FieldError("tool_choice", f"tool_choice names {choice.function.name!r}, not one of {names}")
            return choice.function.name
        return choice or "auto"

    def forced_tool_format(self) -> StructuredOutputsParams | None:
        """The grammar of ``"required"`` or a named function, else None."""
        mode = self.tool_mode()
        if mode in (None, "none", "auto"):
            return None
        tools = {tool.function.name: tool.function.parameters for tool in self.tools or []}
        return forced_tool_format(tools, mode, self.parallel_tool_calls)

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None


def tool_reader(body: ToolFields, parser: str | None, auto_enabled: bool) -> ToolCallReader:
    """How the request's choices are read; ``"auto"`` needs the server's flags (a ``FieldError`` otherwise)."""
    mode = body.tool_mode()
    if mode == "auto" and not (auto_enabled and parser):
        raise FieldError(
            "tool_choice",
            '"auto" tool choice (the default with tools) needs the server started with --enable-auto-tool-choice '
            'and --tool-call-parser; send tool_choice "none", "required" or a named function instead',
        )
    return ToolCallReader(mode, parser)


def tool_call_deltas(calls: list[ToolCall], first_index: int) -> list[dict[str, Any]]:
    """Calls as a stream's ``delta.tool_calls`` (each whole in one delta), numbered from ``first_index``."""
    return [{"index": first_index + i, **call.to_openai()} for i, call in enumerate(calls)]


def template_arguments(arguments: str) -> Any:
    """An assistant message's call arguments as chat templates iterate them: the JSON object, where it is one
    (as vLLM hands them over), else the text. JSON nested too deep is a ``JSONTooDeep``: the template would
    recurse as deep."""
    try:
        value = json_limits.loads(arguments)
    except JSONTooDeep:
        raise
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments
