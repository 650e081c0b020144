"""The request body of ``POST /v1/messages`` (Anthropic's Messages API, as vLLM and SGLang serve it) and its
translation into a chat completion request: the endpoint runs the chat path, with no engine path of its own.

``system`` (text, or text blocks) becomes the first system message; ``messages`` alternate user and assistant
turns whose content is text or blocks: ``text``, an assistant's ``tool_use`` (its ``input`` becomes the call's
arguments) and a user's ``tool_result`` (a ``tool`` message answering that call). ``tools`` are
``{"name", "description", "input_schema"}``; ``tool_choice`` ``auto`` / ``any`` (at least one call: OpenAI's
``required``) / ``tool`` (that one) / ``none``, with ``disable_parallel_tool_use``; ``max_tokens`` (required, as
Anthropic's), ``stop_sequences``, ``output_config.format`` (a JSON schema the grammar holds the text to),
``temperature``, ``top_p``, ``top_k`` (not in Anthropic's newest SDK: send them in ``extra_body``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from paged_backend.entrypoints.openai.protocol import (
    INT64_END,
    MAX_STOP,
    MODEL_CONFIG,
    REQUEST_CONFIG,
    StopString,
    Text,
)
from paged_backend.entrypoints.openai.tools import NAME_PATTERN
from paged_backend.sampling_params import MAX_FLOAT32


class TextBlock(BaseModel):
    model_config = MODEL_CONFIG
    type: Literal["text"]
    text: Text
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint: the prefix cache needs none


class ToolUseBlock(BaseModel):
    model_config = MODEL_CONFIG
    type: Literal["tool_use"]
    id: Text
    name: str = Field(pattern=NAME_PATTERN)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(BaseModel):
    model_config = MODEL_CONFIG
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(block.text for block in self.content)


def _block_kind(value: Any) -> str | None:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


Block = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")],
    Discriminator(
        _block_kind,
        custom_error_type="content_block",
        custom_error_message="must be a text, tool_use or tool_result block",
    ),
]


class AnthropicMessage(BaseModel):
    model_config = MODEL_CONFIG
    role: Literal["user", "assistant"]
    content: Text | Annotated[list[Block], Field(min_length=1)]


class AnthropicTool(BaseModel):
    model_config = MODEL_CONFIG
    name: str = Field(pattern=NAME_PATTERN)
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(BaseModel):
    model_config = MODEL_CONFIG
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, pattern=NAME_PATTERN, description="the tool, for type tool")
    disable_parallel_tool_use: bool | None = None


class JsonOutputFormat(BaseModel):
    model_config = MODEL_CONFIG
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = MODEL_CONFIG
    format: JsonOutputFormat | None = Field(default=None, description="held by the grammar")
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(
        default=None, description="accepted; the model decides how long it thinks"
    )


class MessagesRequest(BaseModel):
    model_config = REQUEST_CONFIG
    model: Text
    max_tokens: int = Field(ge=1, lt=INT64_END)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = Field(default=None, max_length=128)
    tool_choice: AnthropicToolChoice | None = None
    # run as the chat request's ``stop``, which takes at most MAX_STOP: said here, so the schema says it too
    stop_sequences: list[StopString] | None = Field(default=None, max_length=MAX_STOP)
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_FLOAT32)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, lt=INT64_END)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None

    def chat_request(self) -> dict[str, Any]:
        """The chat completion request that runs this one (validated by the caller)."""
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": self.chat_messages(),
            "max_tokens": self.max_tokens,
            "stream": self.stream,
        }
        if self.stream:
            chat["stream_options"] = {"include_usage": True}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                chat[name] = getattr(self, name)
        if self.stop_sequences:
            chat["stop"] = self.stop_sequences
        if self.tools:
            chat["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "parameters": t.input_schema}
                    | ({"description": t.description} if t.description is not None else {}),
                }
                for t in self.tools
            ]
        if self.output_config is not None and self.output_config.format is not None:
            schema = {"name": "output", "schema": self.output_config.format.schema_}
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool":
                chat["tool_choice"] = {"type": "function", "function": {"name": choice.name or ""}}
            else:
                chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
            if choice.disable_parallel_tool_use and self.tools:
                chat["parallel_tool_calls"] = False
        return chat

    def chat_messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.system is not None:
            system = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            blocks = (
                [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
            )
            texts = [block.text for block in blocks if isinstance(block, TextBlock)]
            calls = [
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                for b in blocks
                if isinstance(b, ToolUseBlock)
            ]
            for block in blocks:  # answers to the assistant's calls come first, as tool messages
                if isinstance(block, ToolResultBlock):
                    messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
            if texts or calls:
                turn: dict[str, Any] = {"role": message.role, "content": "\n".join(texts) if texts else None}
                if calls:
                    turn["tool_calls"] = calls
                messages.append(turn)
        return messages
