"""Request bodies of the OpenAI API (the fields this server honours; any other field is a 400 naming it), and
their translation into ``SamplingParams``."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from paged_backend.sampling_params import SamplingParams

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Sampling fields shared by completions and chat (OpenAI's, then vLLM's extras)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(default=1, ge=1)
    best_of: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    user: str | None = None
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def sampling_params(self, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Every field named like a SamplingParams field carries over; raises ValueError naming the field when a
        value is out of range (a 400)."""
        shared = _SAMPLING_FIELDS.intersection(type(self).model_fields) - {"max_tokens", "logprobs"}
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        values = {name: getattr(self, name) for name in shared}
        return SamplingParams(**values, max_tokens=max_tokens, logprobs=logprobs)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False

    def prompts(self) -> list[dict[str, Any]]:
        """The prompt(s) as engine inputs: text, token ids, or a list of either."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [{"prompt": prompt}]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [{"prompt_token_ids": list(prompt)}]
        return [{"prompt_token_ids": list(p)} if isinstance(p, list) else {"prompt": p} for p in prompt]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=1)
