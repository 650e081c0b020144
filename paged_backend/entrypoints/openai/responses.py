"""Response bodies, as the OpenAPI schema documents them (the handlers build plain dicts of this shape; the
fuzz tests check every response against these models)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

FinishReason = Literal["stop", "length", "abort", "tool_calls"] | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy format; an echoed prompt's first token has no logprob (``null``)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None
    decoded_token: str | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    # vLLM's, when asked: per prompt token, null (the first) or {token id: its logprob, rank and text}
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    # vLLM's, with return_token_ids: the prompt's ids (a stream: in the choice's first chunk) and the sampled ids
    # (a stream: each chunk's new ones)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    """One event of a streamed completion; the last one before ``[DONE]`` carries only ``usage`` when
    ``stream_options.include_usage`` asked for it."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[ToolCall] | None = None  # with tools, when the model called any


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it (EOS: null)
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids: the sampled ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids: the rendered conversation's ids


class FunctionDelta(BaseModel):
    name: str | None = None  # in a call's first piece
    arguments: str  # JSON text: the whole arguments (auto), or their next piece (a forced call)


class ToolCallDelta(BaseModel):
    index: int  # the call's place among the choice's calls
    id: str | None = None  # in a call's first piece, with its type
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None = None  # in the last chunk, as vLLM's
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids: the chunk's new sampled ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids: in each choice's first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ReplicaHealth(BaseModel):
    """A data-parallel replica's state (``--data-parallel-size``)."""

    replica: int
    state: str  # running, restarting or dead
    restarts: int
    node_id: str


class Health(BaseModel):
    status: str
    replicas: list[ReplicaHealth] | None = None  # with --data-parallel-size: each replica's state


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ResponseObject(BaseModel):
    """OpenAI's Responses API ``response`` (the fields clients read; ``serving_responses.py`` writes them all)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ResponseEvent(BaseModel):
    """One event of a streamed response: ``type`` names it (``response.output_text.delta``, ...)."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


class AnthropicMessage(BaseModel):
    """Anthropic's Messages API ``message`` (``serving_messages.py`` writes it; an error there is Anthropic's
    shape, ``{"type": "error", "error": {...}}``)."""

    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[dict[str, Any]]
    stop_reason: str | None
    usage: dict[str, int]


class AnthropicEvent(BaseModel):
    """One event of a streamed message: ``type`` names it (``content_block_delta``, ...)."""

    model_config = ConfigDict(extra="allow")
    type: str
