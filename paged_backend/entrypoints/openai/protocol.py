"""Request bodies of the OpenAI API and vLLM's extras, and their translation into ``SamplingParams``. Other
fields of a request body are ignored with a logged warning naming them, as vLLM does; inside nested objects
(messages, stream options) an unknown field is a 400 naming it.

Types are strict, as OpenAI's are: ``"5"``, ``true`` or ``5.0`` is not an integer, ``"yes"`` is not a boolean
(an integer is a number, so ``temperature: 1`` is fine). Every bound ``SamplingParams`` enforces that depends on
one field alone is a schema constraint here, so the OpenAPI schema tells clients the allowed values before they
send them; the rules that tie two fields together (``best_of`` >= ``n``, ``min_tokens`` <= ``max_tokens``, a
prompt plus ``max_tokens`` within ``max_model_len``, ``stream_options`` only with ``stream``) are checked at
request time, each a 400 naming its field. Text fields refuse lone UTF-16 surrogates (``"\\ud800"`` is valid
JSON but not Unicode text: no tokenizer can encode it)."""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from paged_backend.chat_template import chat_template_kwargs
from paged_backend.config import FieldError
from paged_backend.entrypoints.openai.structured_outputs import StructuredOutputRequest
from paged_backend.entrypoints.openai.tools import NAME_PATTERN, ToolFields, template_arguments
from paged_backend.sampling_params import (
    MAX_FLOAT32,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SamplingParams,
    StructuredOutputsParams,
)

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
_SET_HERE = {"max_tokens", "logprobs", "prompt_logprobs", "structured_outputs", "guided_decoding", "logit_bias"}
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

MAX_N = 128  # OpenAI's bound on ``n``; ``best_of`` has the same (each sample is a sequence in one batch)
MAX_STOP = 4  # OpenAI's "up to 4 sequences"
# Prompts in one /v1/completions request: OpenAI's bound on array inputs (the embeddings ``input``), as it
# states none for completions; each prompt is a request of its own in the engine, so this bounds the work one
# HTTP request can queue (times ``best_of``).
MAX_PROMPTS = 2048

# int64 bounds are stated as ``< 2**63`` (exclusiveMaximum): 2**63 is exact in a double, 2**63 - 1 is not, and
# clients (and fuzzers) that read JSON numbers as doubles would round the inclusive bound past int64.
INT64_END = 2**63

MODEL_CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
# A request body's own unknown fields are ignored with a logged warning naming them, as vLLM does (clients and
# harnesses send fields of other servers); nested objects and every known field stay strict.
REQUEST_CONFIG = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


def _no_lone_surrogates(value: str) -> str:
    match = _LONE_SURROGATE.search(value)
    if match is not None:
        raise ValueError(
            f"contains a lone UTF-16 surrogate (U+{ord(match.group()):04X}) at character {match.start()}: "
            "not Unicode text"
        )
    return value


Text = Annotated[str, AfterValidator(_no_lone_surrogates)]
StopString = Annotated[str, Field(min_length=1), AfterValidator(_no_lone_surrogates)]
TokenId = Annotated[int, Field(ge=0, lt=INT64_END)]
# OpenAI's logit_bias: JSON object keys are strings, here a token id's decimal digits; the schema says no other
# key is allowed (pydantic's own leaves other keys open)
_TOKEN_ID_KEY = r"^[0-9]{1,19}$"
_BIAS = {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS}
LogitBias = Annotated[
    dict[
        Annotated[str, Field(pattern=_TOKEN_ID_KEY)],
        Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)],
    ],
    WithJsonSchema({"type": "object", "patternProperties": {_TOKEN_ID_KEY: _BIAS}, "additionalProperties": False}),
]


def _prompt_form(value: Any) -> str | None:
    """Which of the four prompt forms ``value`` is (by its first item), or None for none of them."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, str):
            return "texts"
        if isinstance(first, list):
            return "token_id_lists"
        if isinstance(first, int | float) and not isinstance(first, bool):
            return "token_ids"  # a float is a token id of the wrong type: its error names its index
    return None


Prompt = Annotated[
    Annotated[Text, Tag("text")]
    | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS), Tag("texts")]
    | Annotated[list[TokenId], Field(min_length=1), Tag("token_ids")]
    | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]],
        Field(min_length=1, max_length=MAX_PROMPTS),
        Tag("token_id_lists"),
    ],
    Discriminator(
        _prompt_form,
        custom_error_type="prompt_form",
        custom_error_message=(
            "must be a string, a list of 1 to 2048 strings, a non-empty list of token ids, "
            "or a list of 1 to 2048 non-empty lists of token ids"
        ),
    ),
]


Stop = Annotated[
    Annotated[StopString, Tag("string")] | Annotated[list[StopString], Field(max_length=MAX_STOP), Tag("list")],
    Discriminator(
        lambda value: "string" if isinstance(value, str) else "list" if isinstance(value, list) else None,
        custom_error_type="stop_form",
        custom_error_message=f"must be a non-empty string or a list of at most {MAX_STOP} non-empty strings",
    ),
]


class StreamOptions(BaseModel):
    model_config = MODEL_CONFIG
    include_usage: bool = False


class SamplingFields(StructuredOutputRequest):
    """Sampling fields shared by completions and chat (OpenAI's, then vLLM's extras; the output format's)."""

    model_config = REQUEST_CONFIG

    model: Text
    max_tokens: int | None = Field(default=None, ge=1, lt=INT64_END)
    temperature: float = Field(default=1.0, ge=0.0, le=MAX_FLOAT32)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N, description="at least n; equal to n when greedy")
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = Field(default=None, description="only with stream: true")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, lt=INT64_END, description="at most 2**63 - best_of")
    user: Text | None = None
    top_k: int = Field(default=-1, ge=-1, lt=INT64_END, description="-1 or 0: off")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    min_tokens: int = Field(default=0, ge=0, lt=INT64_END, description="at most max_tokens")
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    logit_bias: LogitBias | None = Field(
        default=None, description="token id -> a number in [-100, 100] added to its logit"
    )
    return_token_ids: bool = Field(
        default=False,
        description=(
            "vLLM's: the prompt's token ids and each choice's sampled token ids in the response (a stream: the "
            "prompt's in its first chunk, each chunk's new ids in its choice), to continue from exactly those ids"
        ),
    )

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and info.data.get("stream") is not True:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return value

    def sampling_params(self, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Every field named like a SamplingParams field carries over; raises ``FieldError`` (a ValueError
        naming the field in ``.field``) when a value breaks a rule between fields (a 400)."""
        shared = _SAMPLING_FIELDS.intersection(type(self).model_fields) - _SET_HERE
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        values = {name: getattr(self, name) for name in shared}
        prompt_logprobs = self.scored_prompt_logprobs()
        structured = self.structured_outputs_params()
        return SamplingParams(
            **values,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=structured,
            logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
        )

    def scored_prompt_logprobs(self) -> int | None:
        """The prompt logprobs the engine computes (none, unless the endpoint asks for them)."""
        return None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(
        default=None, ge=0, lt=INT64_END, description="0 scores the prompt only: with echo and logprobs"
    )
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    prompt_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="vLLM's: each prompt token's logprob and the top k"
    )
    return_tokens_as_token_ids: bool = Field(default=False, description="vLLM's: logprobs' tokens as token_id:N")
    suffix: None = Field(default=None, description="not supported (no insert mode): a 400 unless null")

    @field_validator("suffix", mode="before")
    @classmethod
    def _no_suffix(cls, value: Any) -> None:
        if value is not None:  # as vLLM: refused, never silently dropped
            raise ValueError("suffix is not supported: this server completes a prompt only at its end")
        return value

    def scored_prompt_logprobs(self) -> int | None:
        """The prompt logprobs the engine computes: vLLM's field, or ``logprobs`` for the echoed prompt."""
        echoed = self.logprobs if self.echo else None
        if self.prompt_logprobs is None or echoed is None:
            return self.prompt_logprobs if echoed is None else echoed
        return max(self.prompt_logprobs, echoed)

    def prompts(self) -> list[dict[str, Any]]:
        """The prompt(s) as engine inputs: text, token ids, or a list of either."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [{"prompt": prompt}]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [{"prompt_token_ids": list(prompt)}]
        return [{"prompt_token_ids": list(p)} if isinstance(p, list) else {"prompt": p} for p in prompt]


class TextPart(BaseModel):
    """One part of a message's content given as a list (OpenAI's content parts; text only)."""

    model_config = MODEL_CONFIG
    type: Literal["text"]
    text: Text


class CalledFunction(BaseModel):
    model_config = MODEL_CONFIG
    name: Text = Field(pattern=NAME_PATTERN)
    arguments: Text

    @field_validator("arguments")
    @classmethod
    def _not_too_deep(cls, value: str) -> str:
        template_arguments(value)  # JSONTooDeep, a ValueError: a 400 naming this field
        return value


class MessageToolCall(BaseModel):
    """A tool call of an earlier assistant message."""

    model_config = MODEL_CONFIG
    id: Text
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = MODEL_CONFIG
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = Field(default=None, description="an assistant message's calls")
    tool_call_id: Text | None = Field(default=None, description="a tool message's answer to this call")

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it: content parts joined by newlines (as vLLM does), call
        arguments as JSON objects."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = template_arguments(call["function"]["arguments"])
        return message


class ChatCompletionRequest(SamplingFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="above 0 only with logprobs: true"
    )
    max_completion_tokens: int | None = Field(
        default=None, ge=1, lt=INT64_END, description="OpenAI's newer name of max_tokens; give one, or both equal"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="vLLM's: more variables for the chat template (enable_thinking, ...)"
    )

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """A forced tool call's grammar, or the output format asked for; both at once are a ``FieldError``."""
        forced = self.forced_tool_format()
        if forced is None:
            return super().structured_outputs_params()
        asked = super().output_format_field()
        if asked is not None:
            raise FieldError(
                asked, f"{asked} asks for an output format as tool_choice {self.tool_mode()!r} does: give one"
            )
        return forced

    def output_format_field(self) -> str | None:
        return "tool_choice" if self.forced_tool_format() is not None else super().output_format_field()

    def template_kwargs(self) -> dict[str, Any]:
        """``chat_template_kwargs``, which may not set what the server itself passes to the template."""
        return chat_template_kwargs(self.chat_template_kwargs)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and info.data.get("logprobs") is not True:  # 0 asks for nothing (as in vLLM)
            raise ValueError("top_logprobs > 0 needs logprobs: true")
        return value

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")
        if value is not None and other is not None and value != other:
            raise ValueError(f"max_tokens is {other}: give one of max_tokens and max_completion_tokens, not both")
        return value


class TokenizeCompletionRequest(BaseModel):
    """vLLM's ``/tokenize`` of a text."""

    model_config = REQUEST_CONFIG
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """vLLM's ``/tokenize`` of a conversation, through the chat template."""

    model_config = REQUEST_CONFIG
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = REQUEST_CONFIG
    model: Text | None = None
    tokens: list[TokenId]
