"""The request body of ``POST /v1/responses`` (OpenAI's Responses API, as vLLM serves it) and its translation into
a chat completion request: the endpoint runs the chat path (chat template, grammars, tool-call parsers, reasoning
parser), with no engine path of its own.

``input`` is a string (one user message) or a list of items: messages (``role`` user / system / developer /
assistant, content a string or ``input_text`` / ``output_text`` parts), earlier ``function_call`` items and their
``function_call_output``. ``instructions`` becomes the first system message. ``tools`` are function tools
(``{"type": "function", "name", "description", "parameters", "strict"}``); ``tool_choice`` ``"auto"`` /
``"none"`` / ``"required"`` or ``{"type": "function", "name": ...}``; ``text.format`` a ``json_schema`` (or
``json_object``) held by the grammar; ``max_output_tokens``. Responses are not stored: ``store`` is accepted, and
``previous_response_id`` is a 400 saying to send the conversation in ``input``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from paged_backend.config import FieldError
from paged_backend.entrypoints.openai.protocol import INT64_END, MODEL_CONFIG, REQUEST_CONFIG, Text
from paged_backend.entrypoints.openai.tools import NAME_PATTERN
from paged_backend.sampling_params import MAX_FLOAT32


class TextContent(BaseModel):
    model_config = MODEL_CONFIG
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = None  # an earlier output's, sent back


class MessageItem(BaseModel):
    model_config = MODEL_CONFIG
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[TextContent]
    id: Text | None = None  # an earlier output's, sent back
    status: Text | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    model_config = MODEL_CONFIG
    type: Literal["function_call"]
    call_id: Text
    name: Text = Field(pattern=NAME_PATTERN)
    arguments: Text
    id: Text | None = None
    status: Text | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = MODEL_CONFIG
    type: Literal["function_call_output"]
    call_id: Text
    output: Text
    id: Text | None = None
    status: Text | None = None


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value.get("type", "message"))
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_kind,
        custom_error_type="input_item",
        custom_error_message="must be a message, a function_call or a function_call_output item",
    ),
]


class FunctionTool(BaseModel):
    model_config = MODEL_CONFIG
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    model_config = MODEL_CONFIG
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)


class TextFormat(BaseModel):
    model_config = MODEL_CONFIG
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, description="json_schema's")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description="json_schema's")
    description: Text | None = None
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = MODEL_CONFIG
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = REQUEST_CONFIG
    model: Text
    input: Text | Annotated[list[InputItem], Field(min_length=1)]
    instructions: Text | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, lt=INT64_END)
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_FLOAT32)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: Text | None = Field(default=None, description="not supported: send the whole conversation")
    metadata: dict[str, Text] | None = None
    user: Text | None = None

    def chat_request(self) -> dict[str, Any]:
        """The chat completion request that runs this one (validated by the caller)."""
        if self.previous_response_id is not None:
            raise FieldError(
                "previous_response_id",
                "previous_response_id is not supported (this server stores no responses): send the conversation "
                "so far in input",
            )
        chat: dict[str, Any] = {"model": self.model, "messages": self.messages(), "stream": self.stream}
        if self.stream:
            chat["stream_options"] = {"include_usage": True}
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p), ("user", self.user)):
            if value is not None:
                chat[name] = value
        if self.max_output_tokens is not None:
            chat["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            chat["tools"] = [
                {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                for tool in self.tools
            ]
            chat["parallel_tool_calls"] = self.parallel_tool_calls
        if isinstance(self.tool_choice, FunctionChoice):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        response_format = self.response_format()
        if response_format is not None:
            chat["response_format"] = response_format
        return chat

    def response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.name is None or fmt.schema_ is None:
            raise FieldError("text", "text.format of type json_schema needs its name and schema")
        schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        return {"type": "json_schema", "json_schema": schema}

    def messages(self) -> list[dict[str, Any]]:
        """``instructions`` and ``input`` as chat messages; consecutive function calls join one assistant turn."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return messages
